"""Compiled regions kept in a store (`devmap.generation.region_store`), on the CPU (aot_eager): a continuous batch
compiled with a store gives the eager batch's tokens and saves every region's entries; a fresh process loads them,
traces nothing and gives the same tokens; a cut entry is skipped with one warning, removed and compiled again; a
region that cannot be compiled whole compiles through dynamo; a call whose guards no entry passes compiles one more.
On a GPU (inductor), a second process loads the first one's entries and both get the eager batch's tokens."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devmap.compat import ahead_of_time_keeps
from devmap.generation import region_store
from devmap.generation.continuous import SlotRequest
from devmap.testing import gpu_count

CONFIG = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES = [(5, 6), (9, 3), (3, 8), (11, 4), (7, 7), (4, 5)]


def _requests() -> list[SlotRequest]:
    g = torch.Generator().manual_seed(8)
    return [SlotRequest(torch.randint(3, 500, (n,), generator=g).tolist(), m, f"r{i}")
            for i, (n, m) in enumerate(SHAPES)]


@pytest.fixture
def kept_on_cpu():
    """Where the CPU's backend (aot_eager) has entries this torch can save: else the test that needs them skips."""
    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only (the GPU test runs the store here)")


@pytest.fixture
def store(tmp_path, compiled_on_cpu):
    region_store.keep_regions_in(tmp_path / "regions")
    yield tmp_path / "regions"
    region_store.keep_regions_in(None)


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{region_store.SUFFIX}"))


def _compiled_run(model, run_continuous, rows: int = 4):
    reqs = _requests()
    got, left, _ = run_continuous(model, reqs[:2], reqs[2:], rows=rows, first_slot=12, cache_len=40, lanes=1,
                                  together=False, compile=True)
    assert not left
    return got


def fresh_run(store: Path, device: str = "cpu", backend: str = "aot_eager") -> dict:
    """In a fresh process keeping regions in `store` (with this one's thread count): the tiny model (seed 0) on
    `device`, compiled with `backend`, run as a continuous batch over `_requests()` (4 rows); its tokens, the store's
    compiled and loaded entries and dynamo's graphs."""
    code = f"""
import json, torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig
from devmap.generation import compiled, lanes, mixed_joins, region_store
from devmap.generation.continuous import SlotRequest, generate_continuous
compiled.BACKEND = {backend!r}
if {device!r} == "cpu":
    lanes.graphs_possible = lambda devices: True
mixed_joins.RIDING_MIN_PARAMETERS = 0
region_store.keep_regions_in({str(store)!r})
torch.set_num_threads({torch.get_num_threads()})  # a guard of every entry: torch's global state, threads included
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
model = AutoModelForCausalLM.from_config(LlamaConfig(**{CONFIG!r})).eval().to({device!r})
g = torch.Generator().manual_seed(8)
reqs = [SlotRequest(torch.randint(3, 500, (n,), generator=g).tolist(), m, f"r{{i}}") for i, (n, m) in
        enumerate({SHAPES!r})]
got = {{r.owner: [] for r in reqs}}
queue = list(reqs[2:])
def admit(free, longest, most):
    fits = [r for r in queue if len(r.prompt) <= longest and r.max_new_tokens <= most][:min(free, 1)]
    for r in fits:
        queue.remove(r)
    return fits
def emit(owner, token):
    got[owner].append(token)
    return len(got[owner]) >= dict((r.owner, r.max_new_tokens) for r in reqs)[owner]
generate_continuous(model, reqs[:2], admit, emit, rows=4, first_slot=12, cache_len=40, lanes=1, compile=True)
totals = region_store.region_totals()
print(json.dumps({{"got": got, "compiled": totals.compiled, "loaded": totals.loaded,
                  "graphs": counters["stats"]["unique_graphs"]}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_store_keeps_every_region_and_a_fresh_process_loads_them_without_tracing(model, run_continuous, store,
                                                                                   compiled_on_cpu, kept_on_cpu):
    reqs = _requests()
    eager, _, _ = run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40, lanes=1)
    before = region_store.region_totals()
    for rows in (4, 6):  # a second batch size reuses the entries of the first
        assert _compiled_run(model, run_continuous, rows) == eager
    made = region_store.region_totals()
    assert made.compiled - before.compiled >= 4 and made.loaded == before.loaded  # layers, context, logits, ...
    kept = _entries(store)
    assert len(kept) == made.compiled - before.compiled
    assert not compiled_on_cpu["graph_break"]

    fresh = fresh_run(store)
    assert fresh["got"] == eager  # the same model (seed 0), its tokens from the loaded entries
    assert fresh["compiled"] == 0 and fresh["graphs"] == 0 and fresh["loaded"] == len(kept)


def test_a_cut_entry_is_skipped_with_one_warning_removed_and_compiled_again(model, run_continuous, store, caplog,
                                                                            kept_on_cpu):
    reqs = _requests()
    eager, _, _ = run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40, lanes=1)
    assert _compiled_run(model, run_continuous) == eager
    cut = _entries(store)[0]
    whole = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:100])
    region_store.keep_regions_in(store)  # as a fresh process would: the store's regions read again
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="devmap.generation"):
        assert _compiled_run(model, run_continuous) == eager
    warned = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(warned) == 1 and str(cut) in warned[0]
    assert not cut.exists() or cut.stat().st_size == whole  # removed (another entry took its calls) or made anew
    caplog.clear()
    region_store.keep_regions_in(store)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="devmap.generation"):
        assert _compiled_run(model, run_continuous) == eager
    assert not [r for r in caplog.records if "could not be read" in r.getMessage()]


def test_a_region_that_cannot_compile_whole_compiles_through_dynamo(model, run_continuous, store, compiled_on_cpu,
                                                                    monkeypatch):
    def breaks(*args, **kwargs):
        raise RuntimeError("graph break")

    monkeypatch.setattr(region_store, "ahead_of_time", breaks)
    reqs = _requests()
    eager, _, _ = run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40, lanes=1)
    assert _compiled_run(model, run_continuous) == eager
    assert not _entries(store) and compiled_on_cpu["stats"]["unique_graphs"] > 0


def test_an_entry_that_does_not_read_back_is_not_kept_and_its_region_compiles_through_dynamo(
        model, run_continuous, store, compiled_on_cpu, monkeypatch):
    def unreadable(data, function):
        raise AttributeError("'_Missing' object has no attribute 'forward'")

    monkeypatch.setattr(region_store, "entry_from_bytes", unreadable)
    reqs = _requests()
    eager, _, _ = run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40, lanes=1)
    for rows in (4, 6):
        assert _compiled_run(model, run_continuous, rows) == eager
    assert not _entries(store)


def scaled(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return x * factor + 1


def test_an_entry_serves_only_calls_its_guards_accept(tmp_path, compiled_on_cpu, kept_on_cpu):
    region_store.keep_regions_in(tmp_path)
    try:
        calls = []

        def dynamo(*args):
            calls.append(args)
            return scaled(*args)

        one = region_store.stored_call(scaled, "aot_eager", (torch.ones(3), torch.full((1,), 2.0)), dynamo)
        again = region_store.stored_call(scaled, "aot_eager", (torch.ones(3), torch.full((1,), 3.0)), dynamo)
        other = region_store.stored_call(scaled, "aot_eager", (torch.ones(3, dtype=torch.float64),
                                                               torch.full((1,), 2.0, dtype=torch.float64)), dynamo)
        assert one.tolist() == [3.0] * 3 and again.tolist() == [4.0] * 3 and other.dtype == torch.float64
        assert not calls and region_store.region_totals().compiled >= 2  # float32 once, float64 once
        assert len(list(tmp_path.rglob(f"*{region_store.SUFFIX}"))) == 2
    finally:
        region_store.keep_regions_in(None)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_on_a_gpu_a_second_process_loads_the_first_ones_entries_and_gets_its_tokens(model, run_continuous, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    reqs = _requests()
    try:
        eager, left, _ = run_continuous(model.to("cuda"), reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40,
                                        lanes=1, together=False)
    finally:
        model.to("cpu")
    assert not left
    first = fresh_run(tmp_path, "cuda", "inductor")
    assert first["got"] == eager and first["compiled"] >= 4 and first["loaded"] == 0
    second = fresh_run(tmp_path, "cuda", "inductor")
    assert second["got"] == eager
    assert second["compiled"] == 0 and second["graphs"] == 0 and second["loaded"] == first["compiled"]
