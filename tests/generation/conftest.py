"""A tiny LLaMA for the CPU generation tests (two stages come from split_layers)."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.generation import mixed_joins
from devmap.generation.continuous import generate_continuous

CONFIG = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _tiny_llama(attn_implementation: str | None = None, **overrides) -> torch.nn.Module:
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**CONFIG, **overrides}), **extra).eval()


@pytest.fixture(autouse=True)
def joined_models_ride(monkeypatch):
    """Joined tiny models ride as large ones do (by default devmap's steps carry prompts from 10B parameters on):
    these tests check the riding steps' tokens. A test of the default sets the bound back."""
    monkeypatch.setattr(mixed_joins, "RIDING_MIN_PARAMETERS", 0)


@pytest.fixture(scope="package")
def tiny_llama():
    """A factory: tiny_llama(**config overrides, attn_implementation=...) -> a fresh random tiny LLaMA."""
    return _tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _tiny_llama()


def _run_continuous(model: torch.nn.Module, first: list, later: list, *, together: bool = True,
                   stop_after: int | None = None, **kwargs: object) -> tuple[dict, list, list]:
    """`generate_continuous` on `first`, handing `later` in as rows free up (as
    many as fit at once, or one per step with `together=False`; None from the `stop_after`+1-th call on). Returns
    the tokens each owner got, the owners left unfinished and the requests never started."""
    got: dict = {r.owner: [] for r in first + later}
    budget = {r.owner: r.max_new_tokens for r in first + later}
    queue, calls = list(later), []

    def admit(free: int, longest: int, most: int) -> list | None:
        calls.append(free)
        if stop_after is not None and len(calls) > stop_after:
            return None
        fits = [r for r in queue if len(r.prompt) <= longest and r.max_new_tokens <= most]
        fits = fits[:free if together else min(free, 1)]
        for r in fits:
            queue.remove(r)
        return fits

    def emit(owner: object, token: int) -> bool:
        got[owner].append(token)
        return len(got[owner]) >= budget[owner]

    left = generate_continuous(model, first, admit, emit, **kwargs)  # type: ignore[arg-type]
    return got, left, queue


@pytest.fixture(scope="package")
def run_continuous():
    """A continuous batch with requests handed in as rows free up (see `_run_continuous`)."""
    return _run_continuous


def _compiles_once_for_every_batch_size(model: torch.nn.Module, counters: dict) -> None:
    """A continuous batch of `model` compiled (under `compiled_on_cpu`, whose `counters` these are) at 4, 6 and 8
    rows gives the eager batch's tokens, compiles only for the first size and never breaks its graph."""
    from devmap.generation.continuous import SlotRequest
    from devmap.generation.step_cache import release_graphs

    g = torch.Generator().manual_seed(8)
    reqs = [SlotRequest(torch.randint(3, 500, (n,), generator=g).tolist(), m, f"r{i}")
            for i, (n, m) in enumerate([(5, 6), (9, 3), (3, 8), (11, 4), (7, 7), (4, 5)])]
    eager, left, _ = _run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40, lanes=1)
    assert not left
    try:
        for round, rows in enumerate((4, 6, 8)):
            got, left, _ = _run_continuous(model, reqs[:2], reqs[2:], rows=rows, first_slot=12, cache_len=40,
                                           lanes=1, together=False, compile=True)
            assert not left and got == eager
            if round == 0:
                graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    finally:
        release_graphs(model)


@pytest.fixture(scope="package")
def compiles_once_for_every_batch_size():
    """A check: compiles_once_for_every_batch_size(model, counters) (see `_compiles_once_for_every_batch_size`)."""
    return _compiles_once_for_every_batch_size


@pytest.fixture(scope="package")
def requests_and_their_tokens():
    """A factory: requests_and_their_tokens(reference, seed, count, longest, most_new) -> (requests, tokens)."""
    return _requests_and_their_tokens


def _requests_and_their_tokens(reference: torch.nn.Module, seed: int, count: int, longest: int, most_new: int):
    """`count` random requests (prompts of 3..longest-1 tokens, 1..most_new-1 new ones) and transformers' greedy
    tokens for each alone, on the reference model's device."""
    from devmap.generation.continuous import SlotRequest

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, longest, (count,), generator=g).tolist()
    news = torch.randint(1, most_new, (count,), generator=g).tolist()
    reqs = [SlotRequest(torch.randint(3, 1000, (n,), generator=g).tolist(), m, i)
            for i, (n, m) in enumerate(zip(lengths, news))]
    device = next(reference.parameters()).device
    expected = {r.owner: reference.generate(torch.tensor([r.prompt], device=device), max_new_tokens=r.max_new_tokens,
                                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(r.prompt):]
                .tolist() for r in reqs}
    return reqs, expected


@pytest.fixture(scope="package")
def tritons_interpreter():
    """Runs Python code in a fresh process under TRITON_INTERPRET=1 (Triton's kernels on the CPU); returns its
    completed process. Tests using it skip without Triton."""
    pytest.importorskip("triton")

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=600)

    return run


def _scored_run(model: torch.nn.Module, reqs: list, *, rows: int, first_slot: int, cache_len: int, top: int | None,
                split_layers: list[int] | None = None) -> dict:
    """Each request's (token, score) pairs from a continuous batch that scores its tokens (`top` alternatives; None:
    no scores), the requests joining as rows free up."""
    from devmap.generation.continuous import continuous_batch

    got = {r.owner: [] for r in reqs}
    waiting = list(reqs)
    with continuous_batch(model, rows=rows, first_slot=first_slot, cache_len=cache_len, split_layers=split_layers,
                          scores=top) as batch:
        joining, waiting = waiting[:rows], waiting[rows:]
        while batch.step(joining):
            for owner, token, score in batch.collect(scored=True):
                got[owner].append((token, score))
            free = batch.free_count()
            joining, waiting = waiting[:free], waiting[free:]
        for owner, token, score in batch.collect(everything=True, scored=True):
            got[owner].append((token, score))
    return got


@pytest.fixture(scope="package")
def scored_run():
    """scored_run(model, reqs, rows=, first_slot=, cache_len=, top=, split_layers=) (see `_scored_run`)."""
    return _scored_run
