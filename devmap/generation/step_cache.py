"""Captured stage steps kept on the model between calls, so a repeated batch shape replays instead of recapturing.

A cache holds the steps of one call signature (lane shapes, stage layout) per kind of call; a call with
another signature, or weights that moved since the capture, drops them. `release_graphs(model)` frees
them (and the GPU memory their buffers and graph pools hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ATTRIBUTE = "_devmap_steps"


class StepCache:
    """Steps of one signature, keyed by (stage, lane); pools of captured graphs per device."""

    def __init__(self) -> None:
        self.signature: Any = None
        self.pointers: tuple[int, ...] = ()
        self.entries: dict[Any, Any] = {}
        self.pools: dict[torch.device, Any] = {}

    def use(self, signature: Any, pointers: tuple[int, ...]) -> dict[Any, Any]:
        """The entries for `signature`, emptied first if the signature or the weights' addresses changed."""
        if signature != self.signature or pointers != self.pointers:
            self.entries, self.pools = {}, {}
            self.signature, self.pointers = signature, pointers
        return self.entries

    def pool(self, device: torch.device) -> Any:
        """The graph memory pool shared by this cache's steps on `device` (None off GPUs)."""
        if device.type != "cuda":
            return None
        if device not in self.pools:
            self.pools[device] = torch.cuda.graph_pool_handle()
        return self.pools[device]


def step_cache(model: nn.Module, kind: str) -> StepCache:
    caches = model.__dict__.setdefault(_ATTRIBUTE, {})
    return caches.setdefault(kind, StepCache())


def weight_pointers(model: nn.Module) -> tuple[int, ...]:
    """Addresses of every parameter and buffer: a captured graph reads them, so they must not have moved.

    Walking the module tree costs ~0.5 ms for a LLaMA; the (module, name) slots found by the first walk are
    kept and re-read instead, and a slot whose tensor was replaced triggers a fresh walk. (Replacing a whole
    submodule is not seen: call `release_graphs(model)` after such surgery.)"""
    slots = model.__dict__.get("_devmap_weight_slots")
    if slots is not None and all(getattr(owner, kind).get(name) is tensor for owner, kind, name, tensor in slots):
        return tuple(tensor.data_ptr() for _, _, _, tensor in slots)
    slots = [(module, kind, name, tensor) for module in model.modules()
             for kind in ("_parameters", "_buffers") for name, tensor in getattr(module, kind).items()
             if tensor is not None]
    model.__dict__["_devmap_weight_slots"] = slots
    return tuple(tensor.data_ptr() for _, _, _, tensor in slots)


def release_graphs(model: nn.Module) -> None:
    """Drop the captured steps devmap keeps on `model` (and the GPU memory they hold)."""
    model.__dict__.pop(_ATTRIBUTE, None)
    model.__dict__.pop("_devmap_weight_slots", None)
