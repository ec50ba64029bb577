"""Tensor-parallel plans: each GPU of a group holds 1/N of every attention and MLP block (its KV heads only) and of the
embedding and head where N divides the vocabulary; groups of N GPUs are the pipeline's stages; shapes N does not
divide are refused in one line."""

import json

import pytest
from click.testing import CliRunner

import devmap
from devmap.cli import main
from devmap.errors import UsageError
from devmap.planning.planner import plan_shard, split_map
from devmap.planning.tensor_parallel import TensorSplit
from devmap.planning.workload import parse_workload


def by_hand(config, size: int, itemsize: int = 2) -> int:
    """One GPU's weight bytes under a split of `size`, counted from the config (norms whole, the rest split)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    layer = (2 * h * h + 2 * h * kv + 3 * h * i) // size + 2 * h  # q, o, k, v, gate, up, down; two norms
    vocab = config.vocab_size * h // size * (1 if config.tie_word_embeddings else 2)
    return (layers * layer + vocab + h) * itemsize


@pytest.mark.parametrize("name, size", [("llama-2-13b", 2), ("llama-2-70b", 4), ("tinyllama-1.1b", 2)])
def test_each_gpu_holds_its_share_and_the_totals_are_the_whole_models(name, size):
    whole = devmap.plan(name, "balanced", gpus=size, gpu_memory="200GiB", dtype="bf16")
    split = devmap.plan(name, "balanced", gpus=size, gpu_memory="200GiB", dtype="bf16", tensor_parallel=size)
    assert (split.total_params, split.total_bytes) == (whole.total_params, whole.total_bytes)
    config = whole.model.config
    buffers = sum(b.numel() * b.element_size() for b in split.model.buffers())  # rotary frequencies, whole
    assert [u.bytes for u in split.devices.values()] == [by_hand(config, size) + buffers] * size
    assert set(split.device_map.values()) == {0} and split.stages == 1
    assert split.tensor_parallel == TensorSplit(size, (tuple(range(size)),), vocab=True)


def test_each_gpu_caches_its_own_kv_heads():
    workload = parse_workload("generate", causal_lm=True, batch=8, seq_len=1024)
    whole = devmap.plan("llama-2-13b", "balanced", gpus=2, gpu_memory="200GiB", dtype="bf16", workload=workload)
    split = devmap.plan("llama-2-13b", "balanced", gpus=2, gpu_memory="200GiB", dtype="bf16", workload=workload,
                        tensor_parallel=2)
    kv = sum(u.kv_cache_bytes for u in whole.devices.values())
    assert [u.kv_cache_bytes for u in split.devices.values()] == [kv // 2, kv // 2]


def test_groups_of_gpus_are_the_pipeline_stages():
    plan = devmap.plan("llama-2-13b", "balanced", gpus=4, gpu_memory="80GiB", dtype="bf16", tensor_parallel=2)
    assert plan.tensor_parallel.groups == ((0, 1), (2, 3)) and plan.stages == 2
    assert set(plan.device_map.values()) == {0, 2}  # each group by its first GPU
    for first, second in (("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")):
        assert plan.devices[first].modules == plan.devices[second].modules
        assert plan.devices[first].bytes == plan.devices[second].bytes
    data = plan.to_dict()
    assert data["tensor_parallel"] == {"size": 2, "groups": [[0, 1], [2, 3]], "vocab_split": True}
    assert json.loads(json.dumps(data))["devices"]["cuda:3"]["blocks"] == len(plan.devices["cuda:3"].modules)


def test_a_process_holds_its_gpu_of_each_group_as_the_whole_split_places_it():
    budget = {gpu: "80GiB" for gpu in range(4)}
    whole = devmap.plan("llama-2-13b", "balanced", budget, dtype="bf16", tensor_parallel=2)
    shards = [plan_shard("llama-2-13b", 2, rank, budget, "bf16") for rank in (0, 1)]
    for rank, shard in enumerate(shards):
        assert set(shard.device_map.values()) == {rank, rank + 2} and shard.stages == 2
        assert shard.tensor_parallel == whole.tensor_parallel
        assert {label: usage.bytes for label, usage in shard.devices.items()} == {
            label: whole.devices[label].bytes for label in (f"cuda:{rank}", f"cuda:{rank + 2}")}
        assert shard.total_bytes == sum(usage.bytes for usage in shard.devices.values())
        assert split_map(shard) == whole.device_map  # each block in the same stage on every process
        assert [shard.device_map[name] - rank for name in whole.device_map] == list(whole.device_map.values())
    # process 0's stages are the ones every process places its blocks in, whatever their own budgets say
    lopsided = {0: "80GiB", 1: "80GiB", 2: "4GiB", 3: "4GiB"}
    own = plan_shard("llama-2-13b", 2, 1, lopsided, "bf16")
    told = plan_shard("llama-2-13b", 2, 1, budget, "bf16", stages=split_map(own))
    assert told.device_map == own.device_map != shards[1].device_map


def test_a_shard_uses_the_first_multiple_of_n_gpus_and_a_map_names_groups_by_their_first():
    shard = plan_shard("llama-2-13b", 2, 1, {gpu: "80GiB" for gpu in range(3)}, "bf16")
    assert set(shard.device_map.values()) == {1} and shard.tensor_parallel.groups == ((0, 1),)
    with pytest.raises(UsageError, match="one process per GPU, and the budget has 1"):
        plan_shard("llama-2-13b", 2, 0, {0: "80GiB"}, "bf16")
    with pytest.raises(UsageError, match="invalid rank 2"):
        plan_shard("llama-2-13b", 2, 2, {0: "80GiB", 1: "80GiB"}, "bf16")
    budget = {gpu: "80GiB" for gpu in range(4)}
    whole = devmap.plan("llama-2-13b", "balanced", budget, dtype="bf16", tensor_parallel=2)
    again = devmap.plan("llama-2-13b", dict(whole.device_map), budget, dtype="bf16", tensor_parallel=2)
    assert again.device_map == whole.device_map
    wrong = {name: 1 if key == 2 else key for name, key in whole.device_map.items()}
    with pytest.raises(UsageError, match="by its first .cuda:0, cuda:2., not cuda:1"):
        devmap.plan("llama-2-13b", wrong, budget, dtype="bf16", tensor_parallel=2)


def test_the_vocabulary_splits_only_where_it_divides(tmp_path):
    config = devmap.plan("llama-tiny", gpus=2, gpu_memory="1GiB").model.config
    config.vocab_size = 511
    config.save_pretrained(tmp_path)
    plan = devmap.plan(str(tmp_path), gpus=2, gpu_memory="1GiB", tensor_parallel=2)
    assert not plan.tensor_parallel.vocab
    assert plan.model.get_submodule("lm_head").weight.shape[0] == 511  # whole on each GPU
    assert plan.model.config.num_attention_heads == 2 and plan.model.config.intermediate_size == 80


def test_which_slice_each_gpu_holds():
    split = TensorSplit(2, ((0, 1),), vocab=True)
    layer = "model.layers.3"
    assert split.slice_of(f"{layer}.self_attn.q_proj.weight", (4096, 4096), 1) == (0, 2048, 4096)
    assert split.slice_of(f"{layer}.self_attn.k_proj.weight", (1024, 4096), 0) == (0, 0, 512)
    assert split.slice_of(f"{layer}.self_attn.o_proj.weight", (4096, 4096), 1) == (1, 2048, 4096)
    assert split.slice_of(f"{layer}.mlp.down_proj.weight", (4096, 11008), 0) == (1, 0, 5504)
    assert split.slice_of(f"{layer}.mlp.up_proj.weight", (11008, 4096), 1) == (0, 5504, 11008)
    assert split.slice_of("lm_head.weight", (32000, 4096), 1) == (0, 16000, 32000)
    assert split.slice_of(f"{layer}.input_layernorm.weight", (4096,), 1) is None
    assert TensorSplit(2, ((0, 1),), vocab=False).slice_of("model.embed_tokens.weight", (32001, 4096), 0) is None


@pytest.mark.parametrize("source, size, gpus, message", [
    ("llama-2-13b", 3, 3, "--tensor-parallel 3 does not divide llama-2-13b's 40 attention heads and 40 KV heads: "
                          "use one of 1, 2, 4, 8"),
    ("tinyllama-1.1b", 8, 8, "does not divide tinyllama-1.1b's 4 KV heads: use one of 1, 2, 4"),
    ("llama-2-13b", 2, 3, "groups the GPUs 2 at a time, and the budget has 3: use a multiple of 2 GPUs"),
    ("resnet50", 2, 2, "resnet50 is not one"),
])
def test_splits_that_do_not_divide_are_refused(source, size, gpus, message):
    with pytest.raises(UsageError, match=message):
        devmap.plan(source, gpus=gpus, gpu_memory="80GiB", tensor_parallel=size)
    with pytest.raises(UsageError, match="positive integer"):
        devmap.plan(source, gpus=gpus, gpu_memory="80GiB", tensor_parallel=0)


def test_biased_projections_are_refused(tmp_path):
    config = devmap.plan("llama-tiny", gpus=2, gpu_memory="1GiB").model.config
    config.attention_bias = True
    config.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="biases on its projections"):
        devmap.plan(str(tmp_path), gpus=2, gpu_memory="1GiB", tensor_parallel=2)


def test_the_cli_shows_each_gpu_and_the_groups():
    result = CliRunner().invoke(main, ["plan", "llama-2-13b", "--gpus", "4", "--gpu-memory", "80GiB", "--dtype",
                                       "bf16", "--tensor-parallel", "2"])
    assert result.exit_code == 0, result.output
    assert "Tensor parallel 2: each GPU holds 1/2" in result.output
    assert "the pipeline stages are cuda:0-1, cuda:2-3" in result.output
    assert "model.layers.20 … lm_head → cuda:2-3" in result.output
    assert all(f"cuda:{i}  " in result.output for i in range(4))
    bad = CliRunner().invoke(main, ["plan", "llama-2-13b", "--gpus", "4", "--gpu-memory", "80GiB",
                                    "--tensor-parallel", "3"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "does not divide llama-2-13b's 40 attention heads" in bad.output
