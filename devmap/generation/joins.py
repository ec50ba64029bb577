"""Requests joining a continuous batch together: one prefill of all of a step's joiners (left-padded, their causal
mask built on the device, so no host reads), each one's keys and values copied into its row of its lane's cache.

An eager prefill of a LLaMA stage costs the same few hundred small kernels for one row as for thirty (tens of
milliseconds at 1B, most of it launch and kernel overhead), so joiners go in as one group per step.
"""

from __future__ import annotations

from typing import Any

import torch

from .causal_lm import positions
from .lane_cache import LaneCache


class GroupWriter:
    """The cache a joining group is prefilled with on one stage: each layer's keys and values of the group's rows go
    to their rows in their lanes' caches, at the columns that end where the lanes write next; attention runs over
    the group's own prompts with their mask."""

    def __init__(self, caches: list[LaneCache], targets: list[tuple[torch.Tensor, torch.Tensor] | None],
                 start: int, end: int) -> None:
        self.caches, self.targets, self.start, self.end = caches, targets, start, end

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for cache, target in zip(self.caches, self.targets):
            if target is not None:
                group, rows = target
                cache.keys[layer_idx][:, :, self.start:self.end].index_copy_(0, rows, key.index_select(0, group))
                cache.values[layer_idx][:, :, self.start:self.end].index_copy_(0, rows, value.index_select(0, group))
        return key, value


def padded_prompts(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of the prompts left-padded to the longest, on the host."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        mask[row, length - len(prompt):] = 1
    return ids, mask


def group_context(mask: torch.Tensor, float_mask_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The group's 4-D attention mask and position ids, on the mask's device without reading it on the host: a
    token attends to the attended tokens up to itself (a padding position to itself only, so no row is empty).
    Booleans for sdpa, additive floats (`float_mask_dtype`) for eager attention."""
    length = mask.shape[1]
    own = torch.eye(length, dtype=torch.bool, device=mask.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    keep = (causal[None] & (mask.bool()[:, None, :] | own[None]))[:, None]
    if float_mask_dtype is not None:
        zero = torch.zeros((), dtype=float_mask_dtype, device=mask.device)
        keep = torch.where(keep, zero, torch.finfo(float_mask_dtype).min)
    return {"attention_mask": keep, "position_ids": positions(mask, length)}


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on `device`, copied on the current stream (from pinned memory, without waiting)."""
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
