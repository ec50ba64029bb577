"""Requests joining a continuous batch together: prefills of a step's joiners in sub-groups, each left-padded to a
bucketed shape, their causal mask built on the device (no host reads).

An eager prefill of a LLaMA stage costs the same few hundred small kernels for one row as for thirty, much host
time (transformers' Python) during which the host issues nothing else. So each group
shape's prefill is a captured graph, replayed from its second use on; a step's joiners go in as few sub-groups of
similar lengths (little padding), which the stages run at once, one sub-group behind the other.
"""

from __future__ import annotations

import torch

from .causal_lm import positions


GROUP_TOKENS = 1024  # padded prompt tokens of a joining sub-group (beyond 4 rows): several sub-groups per step
# keep the stages busy at once (sub-group g on stage 1 while g+1 runs on stage 0) and pad little, while each one's
# matrix products stay large enough to run near the GPUs' peak


def group_width(longest: int, first_slot: int) -> int:
    """Columns of a joining sub-group's prefill: a power of two from 64 up, or the batch's first slot (which every
    prompt that may join fits, and no wider: the group's columns end at the lanes' slot)."""
    width = 64
    while width < longest:
        width *= 2
    return min(width, first_slot)


def join_groups(lengths: list[int], first_slot: int, most: int) -> list[tuple[list[int], int, int]]:
    """The joiners (by prompt length) as sub-groups (indices, rows, width) of similar lengths: a sub-group's rows
    are a power of two up to what fits GROUP_TOKENS at its width (at least 4, never more than `most`), so that a
    service sees few prefill shapes, each captured once."""
    by_width: dict[int, list[int]] = {}
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        by_width.setdefault(group_width(lengths[index], first_slot), []).append(index)
    groups = []
    for width, indices in by_width.items():
        cap = _rows_cap(width, most)
        for begin in range(0, len(indices), cap):
            chunk = indices[begin:begin + cap]
            groups.append((chunk, min(cap, 1 << (len(chunk) - 1).bit_length()), width))
    return groups


def join_shapes(first_slot: int, most: int) -> list[tuple[int, int]]:
    """Every (rows, width) of a sub-group `join_groups` can make for a batch of `most` rows and this first slot."""
    widths, width = [], 64
    while width < first_slot:
        widths.append(width)
        width *= 2
    shapes = []
    for width in [*widths, first_slot]:
        cap, rows = _rows_cap(width, most), 1
        while rows < cap:
            shapes.append((rows, width))
            rows *= 2
        shapes.append((cap, width))
    return shapes


def _rows_cap(width: int, most: int) -> int:
    """The most rows of a sub-group of this width: a power of two fitting GROUP_TOKENS, at least 4, at most `most`."""
    return min(most, max(4, 1 << max((GROUP_TOKENS // width).bit_length() - 1, 0)))


def arena_tokens(most: int, cache_len: int) -> int:
    """Tokens (rows × columns) of the largest sub-group `join_groups` makes for a batch of `most` rows and a cache
    of `cache_len` columns: every sub-group's scratch cache fits one arena of this size."""
    return min(most * cache_len, max(GROUP_TOKENS, 4 * cache_len))


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
