"""A shard process of a split service plans each load in the budget rank 0 planned it in: reading the machine itself,
it would see rank 0's GPUs already filling with rank 0's weights (rank 0 sends the load, then loads) and plan the
split as not fitting, a failure that depends on timing."""

import pytest

from devmap.serving import registry as registry_module
from devmap.serving.registry import ModelRegistry
from devmap.serving.shard_worker import RankZeroLoad, ShardRegistry

RANK_0S = {0: 60 * 2**30, 1: 58 * 2**30, "cpu": 100 * 2**30}


def test_a_shard_plans_in_rank_0s_budget_and_never_reads_the_machine(monkeypatch):
    monkeypatch.setattr(registry_module, "resolve_budget", lambda *a, **k: pytest.fail("the shard read the machine"))
    shard = ShardRegistry(tensor_parallel=2)
    shard.given = RankZeroLoad(8, 512, 1, {"model.layers.0": 0}, RANK_0S)
    assert shard._load_budget(None) == RANK_0S
    shard.given = RankZeroLoad(8, 512, 1, {}, "20GiB")  # a load request's own max_memory, as rank 0 was given it
    assert shard._load_budget(None) == "20GiB"


def test_a_whole_service_reads_the_machine_once_at_its_first_load(monkeypatch):
    class Budget:
        limits = {0: 80 * 2**30, "cpu": 2**36}

    reads = []
    monkeypatch.setattr(registry_module, "resolve_budget", lambda *a, **k: reads.append(a) or Budget())
    whole = ModelRegistry()
    assert whole._load_budget(None) == Budget.limits and len(reads) == 1
    assert whole._load_budget("10GiB") == "10GiB"
