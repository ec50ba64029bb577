"""Captured stage steps kept on the model between calls, so a repeated batch shape replays instead of recapturing.

A cache holds the steps of the most recent call signatures (lane shapes, stage layout) per kind of call:
one by default, more after `keep_shapes(model, n)` (a service whose batches come in a few shapes); the
least recently used signature goes first, and weights that moved since the capture drop them all.
`release_graphs(model)` frees them (and the GPU memory their buffers and graph pools hold).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from ..compat import graph_pool

_ATTRIBUTE = "_devmap_steps"


class StepCache:
    """Steps of the recent signatures, keyed by (stage, lane); pools of captured graphs per stage and signature.
    `entries` and `pools` are those of the signature last passed to `use`."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        self.fixed = False  # its capacity was chosen by its kind of call, not by keep_shapes
        self.signature: Any = None
        self.pointers: tuple[int, ...] = ()
        self.entries: dict[Any, Any] = {}
        self.pools: dict[tuple[torch.device, int], Any] = {}
        self._kept: OrderedDict[Any, tuple[dict, dict]] = OrderedDict()
        self._sizes: dict[Any, int] = {}

    def use(self, signature: Any, pointers: tuple[int, ...], size: int = 0, room: int | None = None) -> dict[Any, Any]:
        """The entries for `signature` (new and empty if it is not kept; all are dropped if the weights' addresses
        changed), which becomes the most recently used. `size`: the bytes its entries will hold (its KV caches);
        with `room`, older signatures go first while the kept ones' sizes add up to more than `room` (a memory plan
        made room for one largest shape, not for several)."""
        if pointers != self.pointers:
            self._kept.clear()
            self._sizes.clear()
            self.pointers = pointers
        if signature not in self._kept:
            self._kept[signature] = ({}, {})
            self._sizes[signature] = size
        self._kept.move_to_end(signature)
        while len(self._kept) > max(self.capacity, 1) or (
                room is not None and len(self._kept) > 1 and self.kept_bytes > room):
            oldest, _ = self._kept.popitem(last=False)
            self._sizes.pop(oldest, None)
        self.signature = signature
        self.entries, self.pools = self._kept[signature]
        return self.entries

    @property
    def kept_bytes(self) -> int:
        """What the kept signatures' entries hold, as their `size`s said (their KV caches)."""
        return sum(self._sizes.values())

    @property
    def shapes(self) -> int:
        """How many signatures are kept now."""
        return len(self._kept)

    def pool(self, device: torch.device, stage: int) -> Any:
        """The graph memory pool shared by this cache's steps of one stage (None off GPUs). One per stage, not per
        device: graphs of a pool must never replay at the same time, and stages on one GPU run concurrently."""
        if device.type != "cuda":
            return None
        if (device, stage) not in self.pools:
            self.pools[(device, stage)] = graph_pool()
        return self.pools[(device, stage)]


    def new_pools(self) -> None:
        """Fresh graph pools for the current signature's steps made from now on, for when every step of it is made
        anew (`ContinuousBatch.recompile`): once all graphs of a pool are freed, torch's allocator refuses a capture
        into that pool while its memory waits to be released (an internal assertion on `use_count`), and a capture
        refused so would leave its step eager for good."""
        self.pools.clear()


def step_cache(model: nn.Module, kind: str, capacity: int | None = None) -> StepCache:
    """The model's cache of this kind of call; `capacity` (else `keep_shapes`'s count, else 1) for a new one."""
    caches = model.__dict__.setdefault(_ATTRIBUTE, {})
    if kind not in caches:
        caches[kind] = StepCache(capacity or model.__dict__.get("_devmap_keep_shapes", 1))
        caches[kind].fixed = capacity is not None
    return caches[kind]


def keep_shapes(model: nn.Module, count: int) -> None:
    """Keep the captured steps of the `count` most recent call shapes of each kind (generate, forward) on the
    model, instead of one: each holds its lanes' KV caches and graph pools, so memory grows with `count`."""
    if count < 1:
        raise ValueError(f"keep_shapes needs a count of at least 1, got {count}")
    model.__dict__["_devmap_keep_shapes"] = count
    for cache in model.__dict__.get(_ATTRIBUTE, {}).values():
        if not cache.fixed:
            cache.capacity = count


def weight_pointers(model: nn.Module) -> tuple[int, ...]:
    """Addresses of every parameter and buffer: a captured graph reads them, so they must not have moved.

    Walking the module tree costs host time on every call; the (module, name) slots found by the first walk are
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
