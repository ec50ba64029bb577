"""Shared fixtures: quiet, deterministic, CPU-sized."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _float32_products():
    """Tests that compare float32 outputs exactly turn TF32 matrix products off with a plain assignment
    (`torch.backends.cuda.matmul` answers `allow_tf32` through `__getattr__`, which pytest's monkeypatch cannot
    undo); the setting is put back after every test."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """compile=True on the CPU: steps traced with aot_eager (inductor's tracing and guards, no C++ compiler) along
    the cached-step paths; dynamo reset and its counters cleared before, reset after. Yields dynamo's counters."""
    from torch._dynamo.utils import counters

    from devmap.generation import compiled, lanes

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
