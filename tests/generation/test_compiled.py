"""compile=True on CPU (traced with aot_eager: the same graphs and guards as inductor, no C++ compiler), and the
model families that share LLaMA's glue (Mistral, Qwen2) against transformers' own generate."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from devmap import generate
from devmap.errors import PipelineError, UsageError
from devmap.generation import compiled, forward
from devmap.generation.joined_projections import join_projections

SIZES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def prompts(batch=6, length=9):
    ids = torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def expected(model, ids, mask, new=8):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          eos_token_id=None)


def build(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("joined", [False, True], ids=["transformers-layers", "joined-projections"])
def test_compiled_steps_give_the_same_tokens_and_compile_once(compiled_on_cpu, joined):
    model = build(LlamaConfig(**SIZES))
    if joined:
        assert join_projections(model) == 2 * SIZES["num_hidden_layers"]
    ids, mask = prompts()
    want = expected(model, ids, mask)
    kwargs = dict(max_new_tokens=8, lanes=2, split_layers=[2], eos_token_id=[], compile=True)
    assert torch.equal(generate(model, ids, mask, **kwargs), want)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 and not counters["graph_break"]  # every region traced whole, no breaks
    for _ in range(2):  # the same shapes again: the compiled steps are reused, nothing recompiles
        assert torch.equal(generate(model, ids, mask, **kwargs), want)
    assert counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    for _ in range(2):
        torch.testing.assert_close(forward(model, ids, mask, lanes=3, split_layers=[1, 3], compile=True), reference,
                                   atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.parametrize("joined", [False, True], ids=["transformers-layers", "joined-projections"])
def test_compiling_takes_as_many_graphs_whatever_the_depth(compiled_on_cpu, joined):
    """Steps are compiled region by region: every decoder layer runs one compiled layer (each reads its own part of
    the cache), so a model six layers deep traces no more operations, and compiles no more graphs, than one two deep
    (compiled whole, its steps traced every layer), and tokens stay the same."""
    ids, mask = prompts()
    graphs, traced = [], []
    for depth in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        model = build(LlamaConfig(**{**SIZES, "num_hidden_layers": depth}))
        if joined:
            join_projections(model)
        want = expected(model, ids, mask, new=4)
        got = generate(model, ids, mask, max_new_tokens=4, lanes=1, split_layers=[1], eos_token_id=[], compile=True)
        assert torch.equal(got, want)
        graphs.append(counters["stats"]["unique_graphs"])
        traced.append(counters["stats"]["calls_captured"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] and traced[1] == traced[0]


def test_a_layers_cache_writes_what_the_lanes_cache_writes():
    """`LaneCache.layer(i)` (a compiled layer's view of its keys and values) stores a prompt and then one token per
    step exactly as `LaneCache.update(..., i)` does, in the same buffers."""
    from devmap.generation.lane_cache import LaneCache

    g = torch.Generator().manual_seed(1)
    caches = [LaneCache(2, 8, torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        cache.allocate([0, 1], 2, 4, torch.float32)
    prompt = [torch.randn(2, 2, 3, 4, generator=g) for _ in range(2)]
    tokens = [[torch.randn(2, 2, 1, 4, generator=g) for _ in range(2)] for _ in range(3)]
    for use_layer, cache in zip((False, True), caches):
        for index in (0, 1):
            part = cache.layer(index) if use_layer else None
            out = part.update(*prompt) if use_layer else cache.update(*prompt, index)
            assert all(o is p for o, p in zip(out, prompt))  # a prompt attends to itself only
        cache.start_decoding(3)
        for key, value in tokens:
            for index in (0, 1):
                out = cache.layer(index).update(key, value) if use_layer else cache.update(key, value, index)
                assert out[0] is cache.keys[index] and out[1] is cache.values[index]
            cache.advance()
    for index in (0, 1):
        assert torch.equal(caches[0].keys[index], caches[1].keys[index])
        assert torch.equal(caches[0].values[index], caches[1].values[index])
    assert caches[1].layer(0) is caches[1].layer(0) and caches[1].first_rows(1).layer(0).keys.shape[0] == 1


def test_a_compiled_call_after_an_eager_one_of_the_same_shapes_compiles(compiled_on_cpu):
    """Kept steps are keyed by whether they are compiled: compile=True after an eager call of the same shapes
    compiles its own steps instead of replaying the eager ones (and the other way round)."""
    model = build(LlamaConfig(**SIZES))
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=4, lanes=2, split_layers=[2], eos_token_id=[])
    eager = generate(model, ids, mask, **kwargs)
    assert counters["stats"]["unique_graphs"] == 0
    assert torch.equal(generate(model, ids, mask, compile=True, **kwargs), eager)
    assert counters["stats"]["unique_graphs"] > 0


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_families_sharing_llamas_glue_generate_like_transformers(family):
    if family == "mistral":
        config = MistralConfig(sliding_window=64, **SIZES)
    else:
        config = Qwen2Config(**SIZES)  # q/k/v projections with biases
    model = build(config)
    ids, mask = prompts()
    out = generate(model, ids, mask, max_new_tokens=8, lanes=2, split_layers=[2], eos_token_id=[])
    assert torch.equal(out, expected(model, ids, mask))
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(forward(model, ids, mask, lanes=2, split_layers=[2]), reference, atol=1e-5, rtol=1e-5)


def test_beyond_a_sliding_window_is_refused():
    model = build(MistralConfig(sliding_window=12, **SIZES))
    ids, mask = prompts()
    with pytest.raises(UsageError, match="sliding attention window of 12"):
        generate(model, ids, mask, max_new_tokens=8)


def test_models_with_other_glue_are_refused():
    from transformers import GemmaConfig  # scales its embeddings: LLaMA's glue would be silently wrong

    model = build(GemmaConfig(head_dim=16, **SIZES))
    ids, mask = prompts()
    with pytest.raises(PipelineError, match="this one is 'gemma'"):
        generate(model, ids, mask, max_new_tokens=2)


def test_accelerate_device_hooks_are_bypassed_during_a_call_and_put_back(compiled_on_cpu):
    """A loaded model has accelerate's AlignDevicesHook on every module with weights; compiled through, each one
    is a graph break (they are torch.compiler.disable'd). The call skips them and restores them after."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = build(LlamaConfig(**SIZES))
    ids, mask = prompts()
    want = expected(model, ids, mask)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)) or module is model:
            add_hook_to_module(module, AlignDevicesHook(execution_device="cpu", io_same_device=module is model))
    hooked = {name: module.forward for name, module in model.named_modules()}
    got = generate(model, ids, mask, max_new_tokens=8, lanes=2, split_layers=[2], eos_token_id=[], compile=True)
    assert torch.equal(got, want)
    assert not counters["graph_break"]
    assert all(module.forward == hooked[name] for name, module in model.named_modules())


def test_cli_generate_compile_reports_the_first_call_and_the_steady_one(monkeypatch):
    import json

    from click.testing import CliRunner

    from devmap.cli import main

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    result = CliRunner().invoke(main, ["generate", "llama-tiny", "--max-memory", "cpu=1GB", "--batch-size", "2",
                                       "--prompt-len", "4", "--max-new-tokens", "3", "--compile", "--repeat", "2",
                                       "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["compile"] is True and data["first_call_seconds"] > 0 and data["new_tokens"] <= 3
    result = CliRunner().invoke(main, ["generate", "llama-tiny", "--max-memory", "cpu=1GB", "--max-new-tokens", "2",
                                       "--repeat", "2", "--batch-size", "2", "--prompt-len", "3"])
    assert result.exit_code == 0 and "fastest of 1 calls after the first" in result.output
    torch._dynamo.reset()
