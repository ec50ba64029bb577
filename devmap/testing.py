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
