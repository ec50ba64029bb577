"""GPU-only, one GPU: the live-columns decode attention kernel against the plain computation (eager, compiled for
any rows × columns, captured in a CUDA graph), and a half-precision model decoding with it to transformers' greedy
tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import dispatch
from devmap.kernels import decode_attention
from devmap.kernels.decode_attention import live_columns_attention, reference_attention
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


def _ring_masks(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Each row a live span ending at one shared slot, of its own length, wrapping around the cache's end."""
    slot = int(torch.randint(columns, (1,), generator=generator))
    lengths = torch.randint(1, columns + 1, (rows,), generator=generator)
    back = (slot - torch.arange(columns)) % columns
    return (back[None, :] < lengths[:, None]).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, heads, kv_heads, columns, dim",
                         [(32, 40, 40, 512, 128), (64, 32, 4, 1024, 64), (1, 40, 40, 512, 128), (5, 8, 2, 300, 128)])
def test_kernel_attends_like_the_plain_computation(dtype, rows, heads, kv_heads, columns, dim):
    g = torch.Generator().manual_seed(rows * columns)
    query = torch.randn(rows, heads, 1, dim, generator=g).to("cuda", dtype)
    key = torch.randn(rows, kv_heads, columns, dim, generator=g).to("cuda", dtype)
    value = torch.randn(rows, kv_heads, columns, dim, generator=g).to("cuda", dtype)
    mask = _ring_masks(rows, columns, g)[:, None, None, :]
    got = live_columns_attention(query, key, value, mask)
    torch.testing.assert_close(got.float(), reference_attention(query, key, value, mask).float(), atol=1e-2,
                               rtol=1e-2)


def test_one_compile_of_each_kernel_serves_every_cache_length():
    """Eager launches at cache lengths a service's batches grow through (multiples of 128 columns: chunk counts that
    are and are not multiples of 16) reuse the kernels compiled at the first: none compiles in a serving step."""
    from devmap.kernels.decode_attention_kernel import merge_chunks, partial_attention

    def compiled() -> list[int]:  # Triton's kernels made so far on this device, per kernel
        caches = [kernel.device_caches[torch.cuda.current_device()][0] for kernel in (partial_attention, merge_chunks)]
        return [len(cache) for cache in caches]

    g = torch.Generator().manual_seed(5)
    counts = None
    for columns in (128, 1024, 1152, 2048, 640, 4096):
        query = torch.randn(4, 8, 1, 128, generator=g).to("cuda", torch.bfloat16)
        key = torch.randn(4, 2, columns, 128, generator=g).to("cuda", torch.bfloat16)
        value = torch.randn(4, 2, columns, 128, generator=g).to("cuda", torch.bfloat16)
        mask = _ring_masks(4, columns, g)[:, None, None, :]
        torch.testing.assert_close(live_columns_attention(query, key, value, mask).float(),
                                   reference_attention(query, key, value, mask).float(), atol=1e-2, rtol=1e-2)
        counts = counts or compiled()
        assert compiled() == counts, f"{columns} columns compiled a kernel anew"


def test_kernel_in_a_dynamic_compiled_step_compiles_once_for_any_rows_and_columns_and_replays_in_a_graph():
    """Through devmap's own compile (`compile_region(..., dynamic=True)`, rows and columns marked as a decode step
    marks them): one compile for every shape, and a captured replay that reads the next step's mask and keys."""
    from torch._dynamo.utils import counters

    from devmap.compat import dynamic_dims
    from devmap.generation.compiled import compile_region

    torch._logging.set_logs(recompiles=True)  # a failure's log says which guard failed
    held: dict = {}
    step = compile_region(lambda q: live_columns_attention(q, held["key"], held["value"],
                                                          held["attended"][:, None, None, :]) * 1.0, dynamic=True)
    g = torch.Generator().manual_seed(3)
    counters.clear()
    graphs = None
    for rows, columns in [(8, 512), (16, 512), (8, 1024), (32, 768), (2, 640)]:
        query = torch.randn(rows, 40, 1, 128, generator=g).to("cuda", torch.bfloat16)
        key = torch.randn(rows, 40, columns, 128, generator=g).to("cuda", torch.bfloat16)
        value = torch.randn(rows, 40, columns, 128, generator=g).to("cuda", torch.bfloat16)
        attended = _ring_masks(rows, columns, g)
        dynamic_dims(query, (0,))
        dynamic_dims(key, (0, 2))
        dynamic_dims(value, (0, 2))
        dynamic_dims(attended, (0, 1))
        held.update(key=key, value=value, attended=attended)  # the mask's view made in the step, as a decode step does
        mask = attended[:, None, None, :]
        torch.testing.assert_close(step(query).float(), reference_attention(query, key, value, mask).float(),
                                   atol=1e-2, rtol=1e-2)
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    torch._logging.set_logs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(query)
    attended.copy_(_ring_masks(2, 640, g))  # the next step's mask and keys, in place
    key.normal_()
    graph.replay()
    torch.testing.assert_close(out.float(), reference_attention(query, key, value, mask).float(), atol=1e-2,
                               rtol=1e-2)


CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _half_precision_models(requests_and_their_tokens):
    """(transformers' model, devmap's placed copy, requests, transformers' greedy tokens of each alone), float16."""
    torch.manual_seed(21)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float16).to("cuda:0").eval()
    with torch.no_grad():
        reference.lm_head.weight.mul_(30)  # wide margins between the best tokens: half-precision rounding in
        # another attention kernel must not pick another token
    placed = dispatch(AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float16).eval(), {"": 0})
    placed.load_state_dict(reference.state_dict())
    reqs, tokens = requests_and_their_tokens(reference, 23, 8, 30, 10)
    return reference, placed, reqs, tokens


@pytest.mark.parametrize("joined", [False, True], ids=["transformers-layers", "joined-projections"])
def test_half_precision_model_decodes_transformers_greedy_tokens_with_the_kernel(monkeypatch, run_continuous,
                                                                                 requests_and_their_tokens, joined):
    from devmap import generate
    from devmap.generation.joined_projections import join_projections

    calls = []
    kernel = decode_attention.live_columns_attention
    monkeypatch.setattr(decode_attention, "live_columns_attention", lambda *a: calls.append(1) or kernel(*a))
    reference, placed, reqs, tokens = _half_precision_models(requests_and_their_tokens)
    if joined:
        assert join_projections(placed) == 2 * CONFIG["num_hidden_layers"]
    ids = torch.randint(3, 1000, (4, 12), device="cuda:0")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    for compile in (False, True):
        if compile:  # the counter is a list that compiled code would guard on (a compile per call): eager only
            assert calls
            monkeypatch.undo()
        for _ in range(2):  # run (and compile), then capture and replay
            assert torch.equal(generate(placed, ids, max_new_tokens=12, eos_token_id=[], compile=compile), expected)
            got, left, _ = run_continuous(placed, reqs[:3], reqs[3:], rows=4, first_slot=32, cache_len=48,
                                          compile=compile)
            assert not left and got == tokens


@pytest.mark.parametrize("joined", [False, True], ids=["transformers-layers", "joined-projections"])
def test_half_precision_steps_over_a_batchs_first_rows_compile_once_with_the_kernel(run_continuous,
                                                                                   requests_and_their_tokens, joined):
    """One request, then one joiner a step: the compiled step (the kernel in it) over 2, 4 and 8 rows."""
    from torch._dynamo.utils import counters

    from devmap.generation.joined_projections import join_projections

    _, placed, reqs, tokens = _half_precision_models(requests_and_their_tokens)
    if joined:
        join_projections(placed)
    counters.clear()
    torch._logging.set_logs(recompiles=True)  # a failure's log says which guard failed
    graphs = None
    for round in range(3):  # compile and run, capture, replay
        got, left, _ = run_continuous(placed, reqs[:1], reqs[1:], rows=8, first_slot=32, cache_len=64, lanes=1,
                                      together=False, compile=True)
        assert not left
        assert got == tokens
        if round == 0:
            graphs = counters["stats"]["unique_graphs"]
    torch._logging.set_logs()
    assert counters["stats"]["unique_graphs"] == graphs
