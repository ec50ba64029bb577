"""GPU-only: pipelined LLaMA inference over two GPUs gives one GPU's greedy tokens (fp32) and logits (bf16)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import dispatch, generate
from devmap.generation import forward
from devmap.generation.joined_projections import join_projections
from devmap.testing import require_gpus

pytestmark = require_gpus(2)

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def two_gpu_copy(model):
    placed = copy.deepcopy(model).cpu()
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map |= {f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)}
    return dispatch(placed, device_map)


def left_padded(rows, length, padded_row, pads):
    """Random prompt ids on the first GPU, one row left-padded by `pads` tokens, and their attention mask."""
    ids = torch.randint(3, 1000, (rows, length), device="cuda:0")
    mask = torch.ones_like(ids)
    mask[padded_row, :pads] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.fixture
def lane_runs(monkeypatch):
    """Every LaneRunner the test's calls create, in order."""
    from devmap.generation import api as generation

    runs = []
    original = generation.LaneRunner

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self)

    monkeypatch.setattr(generation, "LaneRunner", Recording)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_gpus_match_one(dtype, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=dtype).to("cuda:0").eval()
    placed = two_gpu_copy(reference)
    ids, mask = left_padded(6, 16, 2, 4)
    with torch.no_grad():
        expected_logits = reference(ids, attention_mask=mask).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: rounding of a different kernel order
    for _ in range(3):  # eager, captured, replayed
        logits = forward(placed, ids, mask, lanes=3).float().to("cuda:0")
        torch.testing.assert_close(logits, expected_logits, atol=tol, rtol=tol)
    if dtype == torch.float32:
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                      pad_token_id=0, eos_token_id=None).cpu()
        assert torch.equal(generate(placed, ids, mask, max_new_tokens=16, lanes=2, eos_token_id=[]), expected)


def test_decode_steps_are_replayed_graphs_and_eos_stops_like_transformers(monkeypatch, lane_runs):
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = two_gpu_copy(reference)
    ids, mask = left_padded(8, 12, 5, 3)
    free = reference.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                              eos_token_id=None).cpu()
    eos = int(free[0, 12 + 4])
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                  eos_token_id=eos).cpu()
    out = generate(placed, ids, mask, max_new_tokens=20, lanes=3, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, expected)
    steps = [step for lane in lane_runs[0].lanes for step in lane.steps]
    assert len(steps) == 6 and all(step.capture_error is None for step in steps)
    assert all(step.graph is not None for step in steps if step.calls > 1)
    eager = generate(placed, ids, mask, max_new_tokens=20, lanes=3, eos_token_id=eos, pad_token_id=0, graphs=False)
    assert torch.equal(eager, expected)
    for seed in (2, 3):  # same shapes, other prompts: cached steps, prefill captured then replayed
        other = torch.randint(3, 1000, ids.shape, generator=torch.Generator().manual_seed(seed)).to("cuda:0")
        other_mask = torch.ones_like(other)
        other_mask[seed, :seed] = 0
        other = other.masked_fill(other_mask == 0, 0)
        want = reference.generate(other, attention_mask=other_mask, max_new_tokens=20, do_sample=False,
                                  pad_token_id=0, eos_token_id=None).cpu()
        got = generate(placed, other, other_mask, max_new_tokens=20, lanes=3, eos_token_id=[], pad_token_id=0)
        assert torch.equal(got, want)


def tied_two_gpu_copy(reference, riding=False):
    """The reference's weights (tied embeddings) over two GPUs as `balanced` places a tied model: lm_head with
    embed_tokens on GPU 0, the final norm after the last layer on GPU 1; `riding`: its projections joined."""
    placed = copy.deepcopy(reference).cpu()
    layers = reference.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "lm_head": 0, "model.rotary_emb": 1, "model.norm": 1}
    device_map |= {f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)}
    placed = dispatch(placed, device_map)
    if riding:
        assert join_projections(placed) == 2 * layers
    return placed


def test_tied_head_on_the_first_gpu_and_norm_on_the_last(monkeypatch):
    """A tied lm_head sits with embed_tokens on GPU 0 while the final norm is on GPU 1. The last stage's head work
    runs on GPU 0 and every reader of that stage's events waits for it: under the stream check its stream sleeps
    before each of its steps (on GPU 0's default stream, as it once ran, a busy GPU gave wrong tokens)."""
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(tie_word_embeddings=True, **CONFIG)).to("cuda:0").eval()
    placed = tied_two_gpu_copy(reference)
    ids = torch.randint(3, 1000, (4, 12), device="cuda:0")
    with torch.no_grad():
        expected_logits = reference(ids).logits
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    eos = int(expected[1, 12 + 3])
    with_eos = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=eos).cpu()
    for _ in range(2):  # eager, then captured or eager again: same tokens and logits each time
        assert torch.equal(generate(placed, ids, max_new_tokens=8, eos_token_id=[]), expected)
        streamed = torch.zeros(4, 8, dtype=torch.long)

        def on_tokens(rows, step, tokens):  # each lane's tokens as they reach the host
            streamed[rows, step] = tokens.view(-1)
            return True

        assert torch.equal(generate(placed, ids, max_new_tokens=8, lanes=2, eos_token_id=eos, pad_token_id=0,
                                    on_tokens=on_tokens), with_eos)
        ended = with_eos.shape[1] - 12  # steps until every row ended (a lane whose rows all ended streams no more)
        assert torch.equal(streamed[:, :ended], with_eos[:, 12:]) and not streamed[:, ended:].any()
        logits = forward(placed, ids, lanes=2).to("cuda:0")
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the model still runs as a plain module afterwards
        torch.testing.assert_close(placed(ids).logits.to("cuda:0"), expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_continuous_batching_with_a_tied_head_on_the_first_gpu(monkeypatch, run_continuous,
                                                                requests_and_their_tokens, riding):
    """Joiners' first tokens and every step's tokens come out of the head on GPU 0 while the last stage is on GPU 1:
    under the stream check (the head's stream sleeping before its work) each request still gets transformers'
    greedy tokens, on capture and on replay."""
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(6)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(tie_word_embeddings=True, **CONFIG)).to("cuda:0").eval()
    placed = tied_two_gpu_copy(reference, riding)
    reqs, expected = requests_and_their_tokens(reference, 7, 14, 20, 16)
    for _ in range(2):
        got, left, queue = run_continuous(placed, reqs[:4], reqs[4:], rows=4, first_slot=20, cache_len=40, lanes=2,
                                          riding=riding)
        assert not left and not queue
        assert got == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_steps_match_one_gpu_and_are_captured(dtype, monkeypatch, lane_runs):
    """compile=True: inductor's kernels inside devmap's graphs give transformers' greedy tokens (fp32) and logits
    within bf16 tolerance, every decode step is captured, and a second call compiles nothing new."""
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(2)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=dtype).to("cuda:0").eval()
    placed = two_gpu_copy(reference)
    ids, mask = left_padded(8, 12, 5, 3)
    with torch.no_grad():
        expected_logits = reference(ids, attention_mask=mask).logits.float()
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  eos_token_id=None).cpu()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for call in range(3):  # compile + run, capture, replay
        logits = forward(placed, ids, mask, lanes=2, compile=True).float().to("cuda:0")
        torch.testing.assert_close(logits, expected_logits, atol=tol, rtol=tol)
        out = generate(placed, ids, mask, max_new_tokens=12, lanes=2, eos_token_id=[], compile=True)
        if dtype == torch.float32:
            assert torch.equal(out, expected)
        if call == 0:
            compiled = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == compiled
    steps = [step for lane in lane_runs[-1].lanes for step in lane.steps]
    assert steps and all(step.graph is not None and step.capture_error is None for step in steps)


def test_continuous_batching_over_two_gpus_gives_each_request_its_own_tokens(monkeypatch, run_continuous):
    """Requests joining free rows between replayed decode steps (streams, events, the token hand-back's lag) get
    transformers' greedy tokens for their prompt alone, on the first run (capture) and on the next (replay)."""
    from devmap.generation.continuous import SlotRequest
    from devmap.generation.step_cache import step_cache

    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = two_gpu_copy(reference)
    g = torch.Generator().manual_seed(4)
    reqs = [SlotRequest(torch.randint(3, 1000, (int(n),), generator=g).tolist(), int(m), i)
            for i, (n, m) in enumerate(zip(torch.randint(3, 20, (14,), generator=g),
                                           torch.randint(1, 16, (14,), generator=g)))]
    expected = {r.owner: reference.generate(torch.tensor([r.prompt], device="cuda:0"), max_new_tokens=r.max_new_tokens,
                                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(r.prompt):]
                .tolist() for r in reqs}
    for _ in range(2):
        got, left, queue = run_continuous(placed, reqs[:4], reqs[4:], rows=4, first_slot=20, cache_len=40, lanes=2)
        assert not left and not queue
        assert got == expected
    entries = step_cache(placed, "continuous").entries
    steps = [step for key, lane in entries.items() if isinstance(key, int) for step in lane[1]]
    assert len(steps) == 4 and all(step.graph is not None for step in steps)
    prefills = [step for key, stages in entries.items() if isinstance(key, tuple) and key[0] == "join"
                for (step, _, _), _ in stages]
    assert prefills and all(step.graph is not None for step in prefills if step.calls > 1)
    assert any(step.calls > 2 for step in prefills)  # replayed
