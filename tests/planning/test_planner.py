"""The planner on simulated GPUs: strategies, budgets, no-split blocks, ties, explicit maps, bad input."""

import json

import pytest
import torch
from accelerate import infer_auto_device_map
from accelerate.utils import get_balanced_memory

from devmap import plan
from devmap.errors import DoesNotFitError, SourceError, UsageError
from devmap.planning.placement import STRATEGIES, module_sizes
from devmap.planning.device_maps import owner_of, validate_device_map

GiB = 2**30


def gpu_bytes(result):
    return {name: u.bytes for name, u in result.devices.items() if name.startswith("cuda")}


def assert_valid(result):
    """Every tensor placed, no-split blocks whole, budgets respected."""
    model = result.model
    validate_device_map(model, result.device_map)
    no_split = set(result.no_split_module_classes)
    for name, module in model.named_modules():
        if type(module).__name__ in no_split:
            inside = [k for k in result.device_map if k.startswith(name + ".")]
            assert not inside, f"no-split block {name} was split: {inside}"
    for usage in result.devices.values():
        if usage.budget is not None and usage.device != "disk":
            assert usage.bytes <= usage.budget, usage
    json.dumps(result.to_dict())


@pytest.mark.parametrize("source", ["resnet50", "tinyllama-1.1b", "llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("n_gpus", [2, 4, 8])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_on_simulated_gpus(source, n_gpus, strategy):
    whole = plan(source, "sequential", gpus=1, gpu_memory="1TiB", dtype="bf16")
    total = whole.total_bytes
    sizes = module_sizes(whole.model, torch.bfloat16)
    block = max(sizes.get(n, 0) for n, m in whole.model.named_modules()
                if type(m).__name__ in whole.no_split_module_classes or not list(m.children()))
    # Budgets where the model fits on the GPUs but not on one of them.
    per_gpu = max(int(total / n_gpus * 1.6), 2 * block)
    result = plan(source, strategy, gpus=n_gpus, gpu_memory=per_gpu, dtype="bf16")
    assert_valid(result)
    used = gpu_bytes(result)
    assert set(result.device_map.values()) <= set(range(n_gpus))
    if strategy in ("auto", "balanced"):
        # min-max split: the fullest GPU holds little more than an even share
        sizes = module_sizes(result.model, torch.bfloat16)
        largest = max(sizes.get(k, 0) for k in result.device_map)
        assert max(used.values()) <= total / n_gpus + largest
    if strategy == "balanced_low_0":
        # GPU 0 carries a lighter share than the fullest other GPU, but is used
        assert 0 < used["cuda:0"] <= max(v for k, v in used.items() if k != "cuda:0")
    if strategy == "sequential":
        # fills GPUs in order: every GPU before the last used one is near its budget
        last = max(i for i in range(n_gpus) if used[f"cuda:{i}"] > 0)
        assert all(used[f"cuda:{i}"] > 0 for i in range(last + 1))


def accelerate_map(result, low_zero=False):
    limits = {k: v for k, v in result.budget.limits.items()}
    balanced = get_balanced_memory(result.model, max_memory=dict(limits), dtype=result.dtype,
                                   no_split_module_classes=result.no_split_module_classes, low_zero=low_zero)
    return infer_auto_device_map(result.model, max_memory=balanced, dtype=result.dtype,
                                 no_split_module_classes=result.no_split_module_classes)


def test_balanced_is_at_least_as_even_as_accelerate():
    # accelerate's own infer_auto_device_map splits a 1.1B LLaMA on 2 x 20 GiB as 11 / 15 entries.
    result = plan("tinyllama-1.1b", "balanced", max_memory={0: "20GiB", 1: "20GiB"}, dtype="bf16")
    sizes = module_sizes(result.model, torch.bfloat16)
    ours = max(gpu_bytes(result).values())
    theirs = accelerate_map(result)
    theirs_max = max(sum(sizes[k] for k, d in theirs.items() if d == g) for g in (0, 1))
    assert ours <= theirs_max
    assert abs(len(result.devices["cuda:0"].modules) - len(result.devices["cuda:1"].modules)) <= 2
    assert ours <= 0.52 * result.total_bytes


def test_balanced_low_0_uses_gpu_0_unlike_accelerate():
    result = plan("tinyllama-1.1b", "balanced_low_0", max_memory={0: "20GiB", 1: "20GiB"}, dtype="bf16")
    theirs = accelerate_map(result, low_zero=True)
    assert set(theirs.values()) == {1}  # accelerate: everything on GPU 1
    used = gpu_bytes(result)
    assert 0.2 * result.total_bytes < used["cuda:0"] < used["cuda:1"]
    # GPU 0 takes half of GPU 1's share: a third of the model, within one block (the split's granularity)
    sizes = module_sizes(result.model, torch.bfloat16)
    block = max(sizes.get(k, 0) for k in result.device_map)
    assert abs(used["cuda:0"] - result.total_bytes / 3) <= block


def test_sequential_matches_accelerate_when_offloading():
    budget = {0: "600MiB", 1: "600MiB", "cpu": "8GiB"}
    result = plan("tinyllama-1.1b", "sequential", max_memory=budget, dtype="bf16")
    theirs = infer_auto_device_map(result.model, max_memory=dict(result.budget.limits), dtype=torch.bfloat16,
                                   no_split_module_classes=result.no_split_module_classes)
    assert result.device_map == dict(theirs)
    assert "cpu" in set(result.device_map.values())
    assert_valid(result)


def test_sequential_keeps_a_fitting_model_on_gpu_0():
    result = plan("resnet50", "sequential", gpus=2, gpu_memory="1GiB")
    assert set(result.device_map.values()) == {0}
    assert result.devices["cuda:1"].bytes == 0


def test_offload_goes_gpu_then_cpu_then_disk():
    result = plan("tinyllama-1.1b", "auto", max_memory={0: "500MiB", 1: "500MiB", "cpu": "500MiB", "disk": "10GiB"},
                  dtype="bf16")
    order = [result.device_map[k] for k in result.device_map]
    rank = {0: 0, 1: 1, "cpu": 2, "disk": 3}
    assert [rank[d] for d in order] == sorted(rank[d] for d in order)
    assert {"cpu", "disk"} <= set(order)
    assert_valid(result)


def test_model_that_fits_nowhere():
    with pytest.raises(DoesNotFitError, match=r"needs .* but the budget holds .*--max-memory"):
        plan("llama-2-70b", gpus=2, gpu_memory="20GiB", dtype="bf16")


def test_dtype_changes_sizes():
    fp32 = plan("resnet50", gpus=1, gpu_memory="1GiB", dtype="float32").total_bytes
    bf16 = plan("resnet50", gpus=1, gpu_memory="1GiB", dtype="bfloat16").total_bytes
    assert fp32 > 1.9 * bf16


def test_tied_weights_stay_together():
    # llama-tiny ties lm_head to embed_tokens; budgets force a split over 3 devices.
    result = plan("llama-tiny", "sequential", max_memory={0: "300KB", 1: "300KB", "cpu": "10MB"})
    assert result.model.lm_head.weight is result.model.model.embed_tokens.weight
    dm = result.device_map
    assert dm[owner_of("lm_head.weight", dm)] == dm[owner_of("model.embed_tokens.weight", dm)]
    assert len(set(dm.values())) > 1


def test_explicit_map():
    dm = {"conv1": 0, "bn1": 0, "relu": 0, "maxpool": 0, "layer1": 0, "layer2": "cuda:0",
          "layer3": 1, "layer4": 1, "avgpool": 1, "fc": "cpu"}
    result = plan("resnet50", dm, max_memory={0: "1GiB", 1: "1GiB", "cpu": "1GiB"})
    assert result.strategy == "explicit"
    assert result.device_map["layer2"] == 0 and result.device_map["fc"] == "cpu"
    assert [str(r) for r in result.runs] == ["conv1 … layer2 → cuda:0", "layer3 … avgpool → cuda:1", "fc → cpu"]


def test_explicit_map_errors():
    budget = {0: "1GiB", 1: "1GiB"}
    with pytest.raises(UsageError, match=r"leaves \d+ tensors unplaced: fc.weight"):
        plan("resnet50", {"conv1": 0, "bn1": 0, "layer1": 0, "layer2": 0, "layer3": 1, "layer4": 1}, budget)
    with pytest.raises(UsageError, match="cuda:5, which does not exist"):
        plan("resnet50", {"": 5}, budget)
    with pytest.raises(UsageError, match="'layer9', which is not a module"):
        plan("resnet50", {"layer9": 0, "": 0}, budget)
    with pytest.raises(UsageError, match="tied parameters"):
        plan("llama-tiny", {"model": 0, "lm_head": 1}, budget)


def test_unknown_strategy_lists_the_four():
    with pytest.raises(UsageError, match="auto, balanced, balanced_low_0, sequential"):
        plan("resnet50", "fastest", gpus=1, gpu_memory="1GiB")


def test_plan_an_nn_module():
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 1000))
    result = plan(model, "balanced", max_memory={0: "8MB", 1: "8MB"})
    assert result.device_map == {"0": 0, "1": 0, "2": 1} or result.device_map == {"0": 0, "1": 1, "2": 1}


def test_local_hf_directory(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300).save_pretrained(tmp_path)
    result = plan(str(tmp_path), "balanced", gpus=2, gpu_memory="400KB")
    assert "LlamaDecoderLayer" in result.no_split_module_classes
    assert set(result.device_map.values()) == {0, 1}


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not valid JSON"),
    ('{"model_type": "no-such-model"}', "transformers cannot read"),
    ('{"hidden_size": 3}', "has no 'model_type'"),
    ('{"model_type": "vit"}', "not a causal language model"),
])
def test_bad_config_json(tmp_path, content, words):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(SourceError, match=words):
        plan(str(tmp_path), gpus=1, gpu_memory="1GiB")


def test_sources_errors(tmp_path):
    with pytest.raises(SourceError, match="resnet18, resnet34"):
        plan("resnet99", gpus=1, gpu_memory="1GiB")
    with pytest.raises(SourceError, match="never contacts a model hub"):
        plan("meta-llama/Llama-2-7b-hf", gpus=1, gpu_memory="1GiB")
    with pytest.raises(SourceError, match="has no config.json"):
        plan(str(tmp_path), gpus=1, gpu_memory="1GiB")


def test_70b_plans_on_meta():
    result = plan("llama-2-70b", "balanced", gpus=2, gpu_memory="80GiB", dtype="bf16")
    assert result.total_params > 68e9
    assert set(result.device_map.values()) == {0, 1}
    assert_valid(result)


def test_a_plans_stages_are_the_runs_of_decoder_layers_on_one_device():
    """What a pipelined LM runs as stages (and a service as lanes): consecutive decoder layers on one device."""
    from dataclasses import replace

    two = plan("llama-tiny", "balanced", gpus=2, gpu_memory="1GiB")
    assert two.stages == 2
    layers = [name for name in two.device_map if name.startswith("model.layers.")]
    back = dict(two.device_map, **{layers[-1]: 0})  # the last layer back on the first GPU: a third stage
    assert replace(two, device_map=back).stages == 3
    assert replace(two, device_map={"": 0}).stages == 1  # the whole model on one device
