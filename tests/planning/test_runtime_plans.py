"""Plans that count what running needs: KV cache, activations, gradients and optimizer state, measured on the
meta device, on the devices of the blocks that hold them; placement leaves room for them; bad shapes refused."""

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import devmap
from devmap.cli import main
from devmap.errors import DoesNotFitError, UsageError
from devmap.planning.runtime_memory import runtime_by_unit
from devmap.planning.workload import parse_workload

GENERATE = parse_workload("generate", causal_lm=True, batch=32, seq_len=2048, chunks=2)


def test_kv_cache_bytes_are_the_closed_form_on_each_layers_device():
    plan = devmap.plan("tinyllama-1.1b", "balanced", gpus=2, gpu_memory="8GiB", dtype="bf16", workload=GENERATE)
    config = plan.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * head_dim * 2 * 32 * 2048  # K and V, bf16, batch × length
    assert sum(u.kv_cache_bytes for u in plan.devices.values()) == per_layer * config.num_hidden_layers
    for usage in plan.devices.values():
        layers = sum(m.startswith("model.layers.") for m in usage.modules)
        assert usage.kv_cache_bytes == per_layer * layers
        assert usage.total == usage.bytes + usage.kv_cache_bytes + usage.activation_bytes + usage.other_bytes
        assert usage.total <= usage.budget


def test_placement_leaves_room_for_the_workload_or_says_it_does_not_fit():
    assert devmap.plan("tinyllama-1.1b", "balanced", gpus=2, gpu_memory="2GiB", dtype="bf16").devices  # weights fit
    with pytest.raises(DoesNotFitError):
        devmap.plan("tinyllama-1.1b", "balanced", gpus=2, gpu_memory="2GiB", dtype="bf16", workload=GENERATE)
    plan = devmap.plan("tinyllama-1.1b", "balanced", max_memory="0=2.5GiB,1=2.5GiB,cpu=20GiB", dtype="bf16",
                       workload=GENERATE)
    assert plan.devices["cpu"].modules  # what the GPUs cannot hold with its cache goes to the CPU
    for key in ("cuda:0", "cuda:1"):
        assert plan.devices[key].total <= plan.devices[key].budget


def test_training_counts_gradients_optimizer_state_and_saved_activations():
    plans = {opt: devmap.plan("resnet18", "balanced", gpus=2, gpu_memory="40GiB",
                              workload=parse_workload("train", causal_lm=False, batch=64, chunks=4, optimizer=opt))
             for opt in ("sgd", "adamw")}
    weights = sum(p.numel() * p.element_size() for p in plans["sgd"].model.parameters())
    assert sum(u.other_bytes for u in plans["sgd"].devices.values()) == weights  # gradients only
    assert sum(u.other_bytes for u in plans["adamw"].devices.values()) == 3 * weights  # + two moments
    assert all(u.kv_cache_bytes == 0 for u in plans["sgd"].devices.values())
    assert sum(u.activation_bytes for u in plans["sgd"].devices.values()) > 10 * weights


def test_measured_bytes_of_a_small_model_are_its_tensors():
    """A Linear's transient peak is its output; for training it saves its input (weights are not activations)."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    for kind, chunks in (("inference", 1), ("train", 2)):
        work = parse_workload(kind, causal_lm=False, batch=16, input_shape=(64,), chunks=chunks, optimizer="sgd")
        needs = runtime_by_unit(model, work, torch.float32, [], causal_lm=False)
        rows = 16 // chunks
        assert needs["0"].transient == rows * 256 * 4
        if kind == "train":
            assert needs["0"].saved == 16 * 64 * 4  # its input, for every micro-batch
            assert needs["0"].other == (64 * 256 + 256) * 4  # its gradients (sgd keeps no state)


@pytest.mark.parametrize("kind", ["generate", "serve", "train"])
def test_a_layer_like_one_measured_takes_its_bytes_as_running_it_would_give(monkeypatch, kind):
    """Decoder layers of the same structure are measured once; each unit's bytes equal measuring every layer."""
    from devmap.planning import runtime_memory
    from devmap.planning.models import resolve_source

    source = resolve_source("tinyllama-1.1b")
    model = source.build()
    work = parse_workload(kind, causal_lm=True, context=2048, batch=8, seq_len=256, chunks=2, optimizer="adamw")
    reused = runtime_by_unit(model, work, torch.bfloat16, ["LlamaDecoderLayer"], causal_lm=True)
    monkeypatch.setattr(runtime_memory, "_structure", lambda layer: object())  # every layer its own: all run
    every = runtime_by_unit(model, work, torch.bfloat16, ["LlamaDecoderLayer"], causal_lm=True)
    assert reused == every
    assert reused["model.layers.3"].transient > 0 and (kind != "train" or reused["model.layers.3"].saved > 0)


@pytest.mark.parametrize("kind", ["generate", "serve"])
def test_a_meta_model_measured_in_place_gives_a_copys_bytes_and_is_left_as_it_was(monkeypatch, kind):
    """A plan's own meta model is measured at the plan's dtype in place (no copy of its modules) and put back: the
    same bytes as measuring a copy, and the same parameters, data, dtypes and buffers after."""
    from devmap.planning import runtime_memory
    from devmap.planning.models import resolve_source

    model = resolve_source("tinyllama-1.1b").build()
    params = {name: (p, p.dtype, p.shape) for name, p in model.named_parameters()}
    buffers = {name: (b, b.dtype) for name, b in model.named_buffers()}
    work = parse_workload(kind, causal_lm=True, context=2048, batch=8, seq_len=256, chunks=2)
    in_place = runtime_by_unit(model, work, torch.bfloat16, ["LlamaDecoderLayer"], causal_lm=True)
    assert all(p is params[name][0] and (p.dtype, p.shape) == params[name][1:] and p.is_meta
               for name, p in model.named_parameters()) and len(params) == len(list(model.parameters()))
    assert all(b is buffers[name][0] and b.dtype == buffers[name][1] for name, b in model.named_buffers())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    copies = []
    real_copy, real_working = runtime_memory._meta_copy, runtime_memory._working_model
    monkeypatch.setattr(runtime_memory, "_meta_copy", lambda m: copies.append(m) or real_copy(m))
    monkeypatch.setattr(runtime_memory, "_working_model", lambda m, dtype, copy_it: real_working(m, dtype, True))
    copied = runtime_by_unit(model, work, torch.bfloat16, ["LlamaDecoderLayer"], causal_lm=True)
    assert copies and copied == in_place


def test_serving_rows_are_the_most_that_fit_whether_all_fit_or_not():
    """`rows_that_fit` takes the service's most rows where they fit (planning twice), else the largest count that
    does (a binary search)."""
    from devmap.planning.rows_fit import rows_that_fit

    asked: list[int | None] = []

    def plan_for(rows):
        asked.append(rows)
        return devmap.plan("tinyllama-1.1b", "balanced", gpus=2, gpu_memory="3GiB", dtype="bf16",
                           workload=None if rows is None else parse_workload(
                               "generate", causal_lm=True, batch=rows, seq_len=2048, chunks=min(2, rows)))

    most, _ = rows_that_fit(plan_for, 4096)
    assert 1 < most < 4096 and len(asked) > 3
    asked.clear()
    rows, plan = rows_that_fit(plan_for, most)
    assert rows == most and plan.workload.batch == most and asked == [None, most]
    assert rows_that_fit(plan_for, most + 1)[0] == most


def test_a_planner_reads_and_builds_its_model_once_and_plans_every_workload_as_plan_does(monkeypatch):
    """`planner` (what a service's load plans through, a dozen workloads per load) resolves the source, reads the
    budget and builds the meta model once; each of its plans is the one `devmap.plan` makes for that workload, and
    every plan after another leaves the shared meta model as it was."""
    from devmap.planning.models import ModelSource, resolve_source
    from devmap.planning.planner import planner

    source = resolve_source("tinyllama-1.1b")
    assert resolve_source(source) is source  # an already resolved source is not read again
    builds = []
    build = ModelSource.build
    monkeypatch.setattr(ModelSource, "build", lambda self, *a, **k: builds.append(a) or build(self, *a, **k))
    args = dict(gpus=2, gpu_memory="3GiB", dtype="bf16")
    plan_for = planner(source, "balanced", **args)
    workloads = [None] + [parse_workload("serve", causal_lm=True, batch=rows, seq_len=2048, chunks=min(2, rows))
                          for rows in (1, 8, 3, 8)]
    plans = [plan_for(w) for w in workloads]
    assert len(builds) == 1
    shapes = {n: (p.shape, p.dtype, p.device) for n, p in plans[0].model.named_parameters()}
    for workload, made in zip(workloads, plans):
        alone = devmap.plan("tinyllama-1.1b", "balanced", workload=workload, **args)
        assert made.device_map == alone.device_map
        assert made.devices == alone.devices
        assert {n: (p.shape, p.dtype, p.device) for n, p in made.model.named_parameters()} == shapes


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="generate", causal_lm=False), "causal LM"),
    (dict(kind="train", causal_lm=True, batch=4), "needs --seq-len"),
    (dict(kind="inference", causal_lm=True, seq_len=9000, context=2048), "longer than the model's context"),
    (dict(kind="inference", causal_lm=True, seq_len=8, input_shape=(3, 8, 8)), "not --input-shape"),
    (dict(kind="inference", causal_lm=False, seq_len=8), "--seq-len is for causal LMs"),
    (dict(kind="train", causal_lm=False, batch=2, chunks=3), "chunks must be between 1 and the batch"),
    (dict(kind="train", causal_lm=False, optimizer="lion"), "unknown optimizer"),
    (dict(kind="decode", causal_lm=True), "unknown workload"),
])
def test_bad_workloads_are_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        parse_workload(**kwargs)


def test_cli_plans_for_a_workload_and_refuses_bad_ones():
    result = CliRunner().invoke(main, ["plan", "tinyllama-1.1b", "--gpus", "2", "--gpu-memory", "8GiB", "--dtype",
                                       "bf16", "--for", "generate", "--batch", "32", "--seq-len", "2048",
                                       "--chunks", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["workload"]["kind"] == "generate"
    for usage in data["devices"].values():
        assert {"weights_bytes", "kv_cache_bytes", "activation_bytes", "other_bytes"} <= set(usage)
        assert usage["kv_cache_bytes"] > 0 and usage["other_bytes"] == 0
    table = CliRunner().invoke(main, ["plan", "resnet18", "--gpus", "1", "--gpu-memory", "40GiB", "--for", "train",
                                      "--batch", "32"])
    assert table.exit_code == 0 and "activations" in table.output and "kv cache" in table.output
    for argv, words in ((["--batch", "4"], "give --for too"),
                        (["--for", "train", "--quantize", "int8", "--seq-len", "8"], "without --quantize")):
        refused = CliRunner().invoke(main, ["plan", "llama-tiny", "--gpus", "1", "--gpu-memory", "1GiB", *argv])
        assert refused.exit_code == 2 and words in refused.output, refused.output


def test_a_load_for_a_workload_leaves_its_room_or_refuses_before_reading():
    small = parse_workload("generate", causal_lm=True, batch=2, seq_len=64)
    model = devmap.load("llama-tiny", "auto", "cpu=2MiB", workload=small)
    assert model.devmap_plan.devices["cpu"].kv_cache_bytes > 0
    large = parse_workload("generate", causal_lm=True, batch=64, seq_len=2048)
    with pytest.raises(DoesNotFitError):
        devmap.load("llama-tiny", "auto", "cpu=2MiB", workload=large)


def test_planning_a_built_model_copies_none_of_its_weights():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    before = [p.detach().clone() for p in model.parameters()]
    work = parse_workload("train", causal_lm=False, batch=8, input_shape=(64,), optimizer="sgd")
    plan = devmap.plan(model, "auto", max_memory="cpu=1GiB", workload=work)
    assert plan.devices["cpu"].activation_bytes > 0
    assert all(p.device.type == "cpu" for p in model.parameters())  # the caller's model is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_serving_gets_the_most_rows_that_keep_the_model_on_its_gpus():
    from devmap.planning.rows_fit import rows_that_fit

    def plan_for(budget):
        def plan(rows):
            workload = None if rows is None else parse_workload("serve", causal_lm=True, batch=rows, seq_len=2048)
            return devmap.plan("tinyllama-1.1b", "balanced", max_memory=budget, dtype="bf16", workload=workload)
        return plan

    rows, plan = rows_that_fit(plan_for("0=4GiB,1=4GiB,cpu=64GiB"), most=64)
    assert 1 < rows < 64 and plan.workload.batch == rows and not plan.devices["cpu"].modules
    assert plan_for("0=4GiB,1=4GiB,cpu=64GiB")(rows + 1).devices["cpu"].modules  # one more row moves a layer off
    assert rows_that_fit(plan_for("0=80GiB,1=80GiB,cpu=64GiB"), most=64)[0] == 64  # the service's max_batch
    with pytest.raises(DoesNotFitError, match=r"one row of 2048 tokens needs .* of weights would move off the GPUs"):
        rows_that_fit(plan_for("0=1.05GiB,1=1.05GiB,cpu=64GiB"), most=64)


@pytest.mark.parametrize("scheme", ["int4", "nf4", "int8"])
def test_a_quantized_model_serves_the_rows_that_keep_its_blocks_where_they_run(scheme):
    # more rows move blocks off the GPUs; 4-bit blocks cannot run on the CPU, so those plans count as not fitting
    # (fewer rows), not as an error that ends the search
    from devmap.planning.rows_fit import rows_that_fit

    def plan(rows):
        workload = None if rows is None else parse_workload("serve", causal_lm=True, batch=rows, seq_len=4096)
        return devmap.plan("llama-2-13b", "balanced", max_memory="0=60GiB,cpu=100GiB", dtype="bf16",
                           quantization=scheme, workload=workload)

    rows, fitting = rows_that_fit(plan, most=64)
    assert 1 < rows < 64 and not fitting.devices["cpu"].modules


def test_a_training_plan_that_fits_has_no_warnings():
    # a pipeline's CUDA graphs share one memory pool per stage, so they hold what the plan counts (measured on a GPU
    # in benchmarks/RESULTS.md); no caveat comes with the plan
    workload = parse_workload("train", causal_lm=False, batch=64, input_shape=(3, 224, 224), chunks=4)
    assert not devmap.plan("resnet50", "balanced", gpus=2, gpu_memory="40GiB", workload=workload).warnings
