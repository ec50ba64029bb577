"""GPU-only, one GPU: several stages on one device (`split_layers`) run every multi-stage path — per-stage streams,
events, hand-offs, per-stage graph pools, lanes, continuous joins — and every call of a seeded matrix (lanes 1-4 x
stages 1-4 x rows 1-32 x graphs on/off, compiled steps, continuous joins) gives transformers' greedy tokens (fp32).

The checks of DEVMAP_STREAM_CHECK are on (`devmap.pipelining.streams`): reader streams sleep before each hand-off
and buffers are poisoned once read, so that an ordering mistake gives wrong tokens in most calls rather than in a
rare one. Without the copy of a replayed graph's output before it leaves its stage (`GraphedStep.handed_on`) the
matrix fails. DEVMAP_STRESS_CALLS (default 200) sets the matrix's size, DEVMAP_STRESS_SEED its seed (a failure
names the seed and the case, so it replays), DEVMAP_STRESS_EAGER=1 keeps graphs off (for TORCH_CUDA_SANITIZER=1,
which cannot follow captures), DEVMAP_STRESS_ATTENTION=eager swaps sdpa for eager attention (the sanitizer reports
sdpa's efficient kernel writing its empty RNG outputs from two streams, which is not devmap's memory).
"""

import copy
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import dispatch, generate
from devmap.generation import joins
from devmap.testing import require_gpus

pytestmark = require_gpus(1)

LAYERS = 8
CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=LAYERS, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CALLS = int(os.environ.get("DEVMAP_STRESS_CALLS", "200"))
SEED = int(os.environ.get("DEVMAP_STRESS_SEED", "0"))
EAGER_ONLY = os.environ.get("DEVMAP_STRESS_EAGER", "") not in ("", "0")
ATTENTION = os.environ.get("DEVMAP_STRESS_ATTENTION", "sdpa")  # "eager" under the sanitizer (see below)


def split(stages: int) -> list[int]:
    """Layer indices that cut LAYERS decoder layers into `stages` runs on the same device."""
    return [round(i * LAYERS / stages) for i in range(1, stages)]


@pytest.fixture(scope="module")
def models():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(11)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation=ATTENTION)
    reference = reference.to("cuda:0").eval()
    placed = dispatch(copy.deepcopy(reference).cpu(), {"": 0})
    return reference, placed


@pytest.fixture(autouse=True)
def checked(monkeypatch):
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", os.environ.get("DEVMAP_STREAM_CHECK", "1"))


@pytest.fixture(autouse=True)
def captures(monkeypatch):
    """Every capture's outcome: a step that could not be captured runs eagerly and still gives the right tokens,
    which would hide that the graph paths were never exercised."""
    from devmap.generation.graphed_step import GraphedStep

    outcomes = {"captured": 0, "failed": []}
    original = GraphedStep._capture

    def capture(self):
        ok = original(self)
        if ok:
            outcomes["captured"] += 1
        else:
            outcomes["failed"].append(repr(self.capture_error)[:300])
        return ok

    monkeypatch.setattr(GraphedStep, "_capture", capture)
    yield outcomes
    assert not outcomes["failed"], f"{len(outcomes['failed'])} captures failed: {outcomes['failed'][:3]}"
    if not EAGER_ONLY:
        assert outcomes["captured"] > 0


def cases(seed: int, calls: int):
    rng = random.Random(seed)
    for index in range(calls):
        rows = rng.choice([1, 2, 3, 5, 8, 13, 16, 24, 32])
        yield index, dict(stages=rng.randint(1, 4), lanes=rng.randint(1, 4), rows=rows, length=rng.randint(4, 24),
                          padded=rng.random() < 0.5, new=rng.randint(2, 16),
                          graphs=False if EAGER_ONLY else rng.random() < 0.75, keep=rng.random() < 0.75)


def prompts(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (case["rows"], case["length"]), generator=g)
    mask = torch.ones_like(ids)
    if case["padded"]:
        pads = torch.randint(0, case["length"] - 1, (case["rows"],), generator=g)
        for row, n in enumerate(pads.tolist()):
            mask[row, :n] = 0
    return ids.masked_fill(mask == 0, 0).to("cuda:0"), mask.to("cuda:0")


def test_every_call_of_the_matrix_gives_transformers_tokens(models):
    reference, placed = models
    failures = []
    for index, case in cases(SEED, CALLS):
        ids, mask = prompts(case, SEED * 100_003 + index)
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=case["new"], do_sample=False,
                                      pad_token_id=0, eos_token_id=None).cpu()
        got = generate(placed, ids, mask, max_new_tokens=case["new"], lanes=case["lanes"],
                       split_layers=split(case["stages"]), graphs=case["graphs"], keep_graphs=case["keep"],
                       eos_token_id=[], pad_token_id=0)
        if not torch.equal(got, expected):
            bad = [r for r in range(got.shape[0]) if not torch.equal(got[r], expected[r])]
            failures.append(f"call {index} {case}: rows {bad}")
    assert not failures, f"{len(failures)} of {CALLS} calls differ (seed {SEED}):\n" + "\n".join(failures[:20])


@pytest.mark.skipif(EAGER_ONLY, reason="compiled steps run inside CUDA graphs")
def test_compiled_steps_over_stages_on_one_gpu(models):
    reference, placed = models
    ids, mask = prompts(dict(rows=8, length=12, padded=True), 7)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                  eos_token_id=None).cpu()
    for _ in range(3):  # compile and run, capture, replay
        got = generate(placed, ids, mask, max_new_tokens=10, lanes=3, split_layers=split(2), eos_token_id=[],
                       pad_token_id=0, compile=True)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("stages", [2, 3])
def test_continuous_joins_over_stages_on_one_gpu(models, run_continuous, requests_and_their_tokens, monkeypatch,
                                                  stages):
    reference, placed = models
    monkeypatch.setattr(joins, "PACK_TOKENS", 48)  # several packs per step
    reqs, expected = requests_and_their_tokens(reference, 20 + stages, 30, 40, 10)
    for _ in range(2):  # capture, then replay
        got, left, queue = run_continuous(placed, reqs[:3], reqs[3:], rows=9, first_slot=40, cache_len=52, lanes=3,
                                          split_layers=split(stages), graphs=not EAGER_ONLY)
        assert not left and not queue
        assert got == expected
