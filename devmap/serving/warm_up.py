"""Compiled decode steps for a service: whether a model gets them, and compiling them while it loads.

A service compiles a model's decode steps (`devmap.generation.compiled`, dynamic sizes: one compile for every batch
shape) where that wins: every block on a GPU and the weights in a floating-point dtype. torchao's quantized weights
stay eager by default: their compile took minutes for a 13B model when every batch shape compiled anew, and was not
faster then; `--compile` asks for it (one dynamic compile, as for any model: its time and speed with quantized
weights are not measured yet). `--no-compile` turns it off. The compile happens at load, in a small continuous batch, so the
first request does not wait for it (tens of seconds the first time; inductor's on-disk cache makes a restart faster).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..generation.continuous import SlotRequest, continuous_batch
from ..generation.step_cache import release_graphs
from .scheduler import CACHE_BUCKET, MIN_ROWS

WARM_UP_STEPS = 4  # the first decode step compiles, the second captures, the rest replay


def compiles(model: nn.Module, wanted: bool | None, quantization: Any) -> bool:
    """Whether the service compiles `model`'s decode steps: `wanted` (None: where it wins: no quantized weights),
    every block on a GPU. Quantized weights compile only when asked (`--compile`)."""
    if wanted is False or (quantization is not None and not wanted):
        return False
    devices = set(getattr(model, "hf_device_map", {"": "cpu"}).values())
    return torch.cuda.is_available() and all(isinstance(d, int) or str(d).startswith("cuda") for d in devices)


def warm_up(model: nn.Module, max_rows: int, context: int) -> None:
    """Run a small continuous batch with compiled steps (compiling them), then free what it captured."""
    cache_len = min(CACHE_BUCKET, context) if context else CACHE_BUCKET
    prompt = [1] * 4
    rows = min(MIN_ROWS, max_rows)
    with continuous_batch(model, rows=rows, first_slot=len(prompt), cache_len=cache_len, compile=True) as batch:
        # every row held: the batch's own decode step compiles; steps over its first rows reuse that compile
        batch.step([SlotRequest(prompt, WARM_UP_STEPS + 1, object()) for _ in range(rows)])
        for _ in range(WARM_UP_STEPS):
            if not batch.step([]):
                break
        batch.collect(everything=True)
    release_graphs(model)
