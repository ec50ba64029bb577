"""Test helpers: GPU gating in one place (`require_gpus(n)`) and tiny models shared by the test suites."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(n: int = 1) -> list[pytest.MarkDecorator]:
    """Marks for a GPU-only test module (`pytestmark = require_gpus(2)`): the `gpu` marker, and a skip
    unless at least `n` CUDA devices are visible."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPU(s), {gpu_count()} visible")]


class ToyModel(nn.Module):
    """The seeds' ToyModel (two linear layers around a ReLU), here without hard-coded devices."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def assert_same_greedy_tokens(ours: torch.Tensor, theirs: object, prompt_length: int, tie: float = 0.02) -> None:
    """`ours` (prompt + new tokens) equals transformers' greedy `generate(..., output_scores=True,
    return_dict_in_generate=True)` result `theirs`, except where a row first departs on a tie: transformers'
    logits for its token and for ours differ by at most `tie` of that step's largest logit (a low-precision
    rounding flip; after it the row's continuations legitimately differ)."""
    sequences = theirs.sequences.to(ours.device)  # type: ignore[attr-defined]
    scores = theirs.scores  # type: ignore[attr-defined]
    ours = ours[:, :sequences.shape[1]]
    assert torch.equal(ours[:, :prompt_length], sequences[:, :prompt_length])
    for row in range(ours.shape[0]):
        differ = (ours[row, prompt_length:] != sequences[row, prompt_length:]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])
        logits = scores[step][row].float()
        want, got = int(sequences[row, prompt_length + step]), int(ours[row, prompt_length + step])
        gap = float(logits[want] - logits[got])
        assert gap <= tie * float(logits.abs().max()), (
            f"row {row} departs at new token {step}: {got} instead of {want}, {gap:.4g} below it (not a tie)")

