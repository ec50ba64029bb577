"""Shared fixtures: quiet, deterministic, CPU-sized."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
