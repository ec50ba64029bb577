"""GPU-only, one GPU: a continuous batch's captured steps, its joining packs and its wrapping cache give each
request transformers' greedy tokens (fp32), eager and compiled."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import dispatch
from devmap.generation import joins
from devmap.generation.continuous import SlotRequest
from devmap.generation.joined_projections import join_projections
from devmap.testing import require_gpus

pytestmark = require_gpus(1)

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
JOINS = pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])


def placed_copy(reference: torch.nn.Module, riding: bool) -> torch.nn.Module:
    """The reference's weights in a dispatched model on cuda:0; `riding`: with its projections joined (the decode
    steps carry joiners' prompts)."""
    placed = dispatch(AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval(), {"": 0})
    placed.load_state_dict(reference.state_dict())
    if riding:
        assert join_projections(placed) == 2 * CONFIG["num_hidden_layers"]
    return placed


@JOINS
def test_continuous_batch_on_one_gpu_wraps_its_cache_and_gives_each_request_its_tokens(monkeypatch, run_continuous,
                                                                                       requests_and_their_tokens,
                                                                                       riding):
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    monkeypatch.setattr(joins, "PACK_TOKENS", 64)  # several packs in a step
    torch.manual_seed(5)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = placed_copy(reference, riding)
    reqs, expected = requests_and_their_tokens(reference, 6, 36, 60, 12)
    news = [r.max_new_tokens for r in reqs]
    for _ in range(2):  # capture, then replay
        got, left, queue = run_continuous(placed, reqs[:3], reqs[3:], rows=6, first_slot=60, cache_len=72)
        assert not left and not queue
        assert got == expected
    assert sum(news) / 6 > 2 * (72 - 60)  # steps enough for the slot to go round the cache more than once


@JOINS
def test_compiled_steps_on_one_gpu_give_transformers_tokens(monkeypatch, run_continuous, riding):
    """compile=True (inductor) with the decode step marking its mask column inside the step: generate and a
    continuous batch give transformers' greedy tokens, on capture and on replay."""
    from devmap import generate

    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(8)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = placed_copy(reference, riding)
    ids = torch.randint(3, 1000, (4, 10), device="cuda:0")
    expected = reference.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    g = torch.Generator().manual_seed(9)
    reqs = [SlotRequest(torch.randint(3, 1000, (int(n),), generator=g).tolist(), 6, i)
            for i, n in enumerate(torch.randint(3, 30, (8,), generator=g))]
    tokens = {r.owner: reference.generate(torch.tensor([r.prompt], device="cuda:0"), max_new_tokens=6,
                                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(r.prompt):]
              .tolist() for r in reqs}
    for _ in range(3):  # compile + run, capture, replay
        assert torch.equal(generate(placed, ids, max_new_tokens=10, eos_token_id=[], compile=True), expected)
        got, left, _ = run_continuous(placed, reqs[:2], reqs[2:], rows=4, first_slot=32, cache_len=40, compile=True)
        assert not left and got == tokens


def test_generation_whose_caches_cannot_fit_is_refused_before_anything_is_allocated():
    import pytest

    from devmap import generate
    from devmap.errors import DoesNotFitError

    placed = dispatch(AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval(), {"": 0})
    before = torch.cuda.memory_allocated(0)
    rows = 2 * torch.cuda.mem_get_info(0)[1] // (4 * 2 * 2 * 32 * 4 * 256) + 1  # 4 layers' fp32 caches, 256 tokens
    with pytest.raises(DoesNotFitError, match=f"devmap.generate of {rows} rows × 256 tokens needs .* on cuda:0"):
        generate(placed, torch.ones(rows, 128, dtype=torch.long), max_new_tokens=128)
    assert torch.cuda.memory_allocated(0) == before


@JOINS
def test_compiled_steps_over_a_batchs_first_rows_compile_nothing_more_and_give_transformers_tokens(monkeypatch,
                                                                                                   run_continuous,
                                                                                                   riding):
    """A batch of 8 rows holding one request decodes 2 rows, then 4, then all 8 as requests join: captures of the
    same compiled step over the first rows (no recompile: a compile of a new row count would cost tens of seconds
    in the middle of traffic), each request with transformers' greedy tokens."""
    from torch._dynamo.utils import counters

    torch.manual_seed(11)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = placed_copy(reference, riding)
    g = torch.Generator().manual_seed(12)
    reqs = [SlotRequest(torch.randint(3, 1000, (int(n),), generator=g).tolist(), 8 + 3 * i, i)
            for i, n in enumerate(torch.randint(3, 30, (9,), generator=g))]
    tokens = {r.owner: reference.generate(torch.tensor([r.prompt], device="cuda:0"), max_new_tokens=r.max_new_tokens,
                                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(r.prompt):]
              .tolist() for r in reqs}
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    counters.clear()
    graphs = None
    for round in range(3):  # compile + run, capture, replay
        got, left, _ = run_continuous(placed, reqs[:1], reqs[1:], rows=8, first_slot=32, cache_len=64, lanes=1,
                                      together=False, compile=True)
        assert not left and got == tokens
        if round == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


@JOINS
def test_scored_steps_on_one_gpu_carry_the_log_softmax_of_transformers_logits(riding, scored_run):
    """A scoring batch on a GPU (captured steps, joiners prefilled or riding): every token's log-probability and top
    3 alternatives are those of transformers' logits for the request's tokens so far (fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    torch.manual_seed(11)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = placed_copy(reference, riding)
    g = torch.Generator().manual_seed(3)
    reqs = [SlotRequest(torch.randint(3, 1000, (int(n),), generator=g).tolist(), 7, i)
            for i, n in enumerate(torch.randint(3, 30, (7,), generator=g))]
    got = scored_run(placed, reqs, rows=4, first_slot=32, cache_len=48, top=3)
    for request in reqs:
        pairs = got[request.owner]
        ids = torch.tensor([request.prompt + [token for token, _ in pairs]], device="cuda:0")
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(ids).logits[0].float(), -1).cpu()
        for i, (token, (value, top)) in enumerate(pairs):
            row = logprobs[len(request.prompt) - 1 + i]
            assert token == row.argmax().item() and abs(value - row[token].item()) < 1e-3
            assert [t for t, _ in top] == row.topk(3).indices.tolist()
