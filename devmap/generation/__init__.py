"""Generation: LLaMA-style causal LMs run through their stages in lanes, for prefill and token-by-token decoding.

Owns the causal-LM stage view (embedding, layers, norm and head per device), lanes with static KV caches
on every stage (their prefill and decode halves), captured steps and their cache on the model, sampling, and
continuous batches (rows that requests join between steps, driven step by step by their caller). Imports
`devmap.pipelining` (its streams), `devmap.planning`, `devmap.kernels` (the products and attention its steps call),
`devmap.compat` and `devmap.errors`. `generate`, `forward`,
`timed` and `check_length` are re-exported here.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["check_length", "forward", "generate", "timed"]


def __getattr__(name: str) -> Any:
    """The re-exported functions, imported on first use: the package's light modules (`row_types`) come without the
    model stack."""
    if name in __all__:
        value = getattr(importlib.import_module(".api", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
