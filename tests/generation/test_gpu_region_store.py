"""GPU-only: compiled regions kept in a store (inductor): a fresh process compiles and saves every region's entries,
the next loads them, traces nothing, and both give the greedy tokens of the eager, captured batch (float32)."""

import torch

from devmap.testing import require_gpus

from .test_region_store import _requests, fresh_run

pytestmark = require_gpus(1)


def test_a_second_process_loads_the_first_ones_entries_and_gets_its_tokens(model, run_continuous, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    reqs = _requests()
    eager, left, _ = run_continuous(model.to("cuda"), reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40,
                                    lanes=1, together=False)
    model.to("cpu")
    assert not left
    first = fresh_run(tmp_path, "cuda", "inductor")
    assert first["got"] == eager and first["compiled"] >= 4 and first["loaded"] == 0
    second = fresh_run(tmp_path, "cuda", "inductor")
    assert second["got"] == eager
    assert second["compiled"] == 0 and second["graphs"] == 0 and second["loaded"] == first["compiled"]
