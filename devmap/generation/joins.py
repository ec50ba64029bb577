"""Requests joining a continuous batch together: one prefill of all of a step's joiners, left-padded to a bucketed
group shape, their causal mask built on the device (no host reads).

An eager prefill of a LLaMA stage costs the same few hundred small kernels for one row as for thirty: tens of
milliseconds of host time at 1B (transformers' Python), during which the host issues nothing else. So joiners go
in as one group per step, and each group shape's prefill is a captured graph, replayed from its second use on.
"""

from __future__ import annotations

import torch

from .causal_lm import positions


def group_rows(count: int, most: int) -> int:
    """Rows of a joining group's prefill: few shapes (4, 16, or every row of the batch), each captured once."""
    return next((size for size in (4, 16) if count <= size < most), most)


def group_width(longest: int, first_slot: int) -> int:
    """Columns of a joining group's prefill: 64, 256, or the batch's first slot (which every prompt that may join
    fits, and no wider: the group's columns end at the lanes' slot)."""
    return next((width for width in (64, 256) if longest <= width <= first_slot), first_slot)


def padded_prompts(prompts: list[list[int]], pad: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of the prompts left-padded to `width` (default: the longest), on the host."""
    length = width or max(len(p) for p in prompts)
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


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied on the current stream (from pinned memory, so the host does not wait)."""
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on `device` (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)
