"""A service plans each load for its largest batch: as many rows as its budget leaves room for (each with the
longest cache a request may need), refuses a model with room for none (409, with numbers), keeps its batches and
their kept KV caches within that plan, and shows planned beside used memory in /metrics."""

import asyncio

import pytest

from dataclasses import replace

import torch

import devmap
from devmap.planning.models import resolve_source
from devmap.planning.runtime_memory import layer_kv_bytes
from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry
from devmap.serving.errors import DoesNotFit
from devmap.serving.load_plan import plan_serving

LIMITS = EngineLimits(max_batch=16, max_prompt_tokens=64, max_new_tokens=32)


def serving_plan(path, budget, most=LIMITS.max_batch):
    """What the service plans for the model at `path` within `budget`, with batches of at most `most` rows."""
    def plan_with(workload):
        return devmap.plan(str(path), "auto", budget, workload=workload)
    return plan_serving(resolve_source(str(path)), replace(LIMITS, max_batch=most), plan_with)


def row_bytes(path, cache_len=128):
    """One row's KV cache counted by hand from the config: keys and values (2) of every KV head's head_dim floats
    (4 bytes) for each cached token, in every layer."""
    config = resolve_source(str(path)).config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * 4
    assert per_token * cache_len * config.num_hidden_layers == \
        config.num_hidden_layers * layer_kv_bytes(config, torch.float32, 1, cache_len)  # what the planner counts
    return config.num_hidden_layers * cache_len * per_token


def test_a_load_gets_the_most_rows_its_budget_has_room_for(model_root):
    path = model_root / "tiny"
    weights = serving_plan(path, "cpu=2GB").plan.devices["cpu"].bytes
    budget = f"cpu={weights + 20 * row_bytes(path)}"
    registry = ModelRegistry(model_root, "auto", budget, limits=LIMITS)
    resident = registry.load(path)
    assert 1 < resident.max_rows < LIMITS.max_batch
    assert resident.cache_len == 128  # 64 prompt + 32 new tokens, in the scheduler's buckets
    assert serving_plan(path, budget, resident.max_rows + 1).rows == resident.max_rows  # one more does not fit
    usage = resident.model.devmap_plan.devices["cpu"]
    assert resident.planned["cpu"] == usage.total
    assert resident.kv_room == resident.max_rows * row_bytes(path)
    scratch = min(16, resident.max_rows)  # a joining pack's scratch rows: 2048 tokens of 128, at most the rows
    assert usage.kv_cache_bytes == (resident.max_rows + scratch) * row_bytes(path)
    assert resident.describe()["max_batch"] == resident.max_rows
    assert registry.planned() == resident.planned


def test_a_model_with_no_room_for_one_row_is_refused_with_numbers(model_root):
    path = model_root / "tiny"
    weights = serving_plan(path, "cpu=2GB").plan.devices["cpu"].bytes
    registry = ModelRegistry(model_root, "auto", f"cpu={weights + 1024}", limits=LIMITS)
    with pytest.raises(DoesNotFit) as refused:
        registry.load(path)
    assert refused.value.status == 409
    message = refused.value.message
    assert "does not fit" in message and "no room for one row" in message and "serve 1 × 128 tokens" in message
    assert "KiB of weights" in message
    assert registry.all() == []


def test_batches_stay_within_the_rows_and_kv_room_the_plan_made(model_root):
    from devmap.generation.step_cache import step_cache

    path = model_root / "tiny"
    weights = serving_plan(path, "cpu=2GB").plan.devices["cpu"].bytes
    registry = ModelRegistry(model_root, "auto", f"cpu={weights + 7 * row_bytes(path)}", limits=LIMITS)
    resident = registry.load(path)
    assert 2 <= resident.max_rows <= 4
    engine = Engine(registry, LIMITS)
    engine.start()
    params = GenerationParams(max_new_tokens=6, temperature=0)

    async def ask() -> list[str]:
        answers = await asyncio.gather(*(engine.complete("tiny", [5 + i, 6, 7], params) for i in range(7)))
        return [a.text for a in answers]

    try:
        together = asyncio.run(ask())
        alone = [asyncio.run(engine.complete("tiny", [5 + i, 6, 7], params)).text for i in range(7)]
        metrics = engine.render_metrics().decode()
    finally:
        engine.close(timeout=60)
    assert together == alone
    assert resident.batch_shape.rows <= resident.max_rows
    kept = step_cache(resident.model, "continuous")
    assert kept.kept_bytes <= resident.kv_room
    planned = next(line for line in metrics.splitlines() if line.startswith('devmap_device_memory_planned_bytes{'))
    assert 'device="cpu"' in planned and float(planned.split()[-1]) == resident.planned["cpu"]


def test_a_service_plans_max_batch_rows_per_pipeline_stage_and_their_kv_on_every_gpu(model_root):
    """Over two (simulated) GPUs a model's batches run in two lanes, each of up to max_batch rows: the plan holds
    2 × max_batch rows, each GPU the KV cache of its own layers for all of them."""
    path = model_root / "tiny"

    def plan_with(workload, gpus=2):
        return devmap.plan(str(path), "balanced", gpus=gpus, gpu_memory="1GiB", workload=workload)

    two = plan_serving(resolve_source(str(path)), LIMITS, plan_with)
    assert two.plan.stages == 2 and two.lanes == 2 and two.rows == 2 * LIMITS.max_batch
    assert two.plan.workload.chunks == 2 and two.plan.workload.batch == two.rows
    kv = {name: usage.kv_cache_bytes for name, usage in two.plan.devices.items()}
    assert all(kv[name] > 0 for name in ("cuda:0", "cuda:1"))
    one = plan_serving(resolve_source(str(path)), LIMITS, lambda workload: plan_with(workload, gpus=1))
    assert one.plan.stages == 1 and one.lanes == 1 and one.rows == LIMITS.max_batch
    told = plan_serving(resolve_source(str(path)), replace(LIMITS, lanes=3), plan_with)
    assert told.lanes == 3 and told.rows == 3 * LIMITS.max_batch  # --lanes decides where given


def test_a_split_models_plan_counts_every_gpu_of_its_groups():
    """A split service's process 0 holds its GPU of each group; what it plans there every GPU of the group holds, so
    the service's budget and /metrics count the shard processes' GPUs too."""
    from devmap.planning.planner import plan_shard
    from devmap.serving.registry import _planned

    shard = plan_shard("llama-2-13b", 2, 0, {gpu: "80GiB" for gpu in range(4)}, "bf16")
    planned = _planned(shard)
    assert set(planned) == {0, 1, 2, 3}
    assert planned[0] == planned[1] == shard.devices["cuda:0"].total
    assert planned[2] == planned[3] == shard.devices["cuda:2"].total
