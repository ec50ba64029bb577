"""Requests joining a continuous batch together: one step's joiners' prompts packed end to end into a few sequences
(packs) of one row each, whose attention mask keeps every prompt to its own tokens, causally, and whose positions
count from each prompt's start. Nothing is padded but a pack's tail.

Left-padding joiners to a shared width, as a batched prefill does, costs what the padding costs: with prompts of
mixed lengths, sub-groups of power-of-two widths and rows computed about 1.5 times their tokens. A pack computes
its prompts' tokens and the padding up to its width: its bucket's, or, where the pack rides a decode step, a wider one
the batch already made, up to twice its own (`reused_width`), so that a wave of prompts settles on one width. Each
bucket's prefill is a captured graph, replayed from its second use on (an eager prefill of a LLaMA stage is a few
hundred small kernels of host time).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


JoinShape = tuple[int, int]
"""The shape of a step that takes joiners in: the rows it computes beside the pack (0 for a prefill of its own) and the
pack's width. A batch makes a step per shape at its first use and captures it at its second
(`ContinuousBatch.join_shapes`); a service remembers the ones it met and makes them before its next start serves."""

PACK_TOKENS = 2048  # tokens of a pack at most (or the batch's cache length, if longer: any prompt fits one pack):
# several packs in a step keep the stages busy at once (pack g on stage 1 while g+1 runs on stage 0), while each
# one's matrix products stay large enough to run near the GPUs' peak


def pack_limit(cache_len: int, rows: int) -> int:
    """The most tokens of one pack for a batch of `rows` rows of `cache_len` tokens: PACK_TOKENS, or the cache
    length if longer (any prompt fits one pack), or the batch's whole cache if smaller (its rows' prompts together)."""
    return min(rows * cache_len, max(PACK_TOKENS, cache_len))


def pack_widths(limit: int) -> list[int]:
    """Every width a pack of at most `limit` tokens can take: multiples of 64 up to 256, then four widths per
    doubling (320, 384, 448, 512, 640, ...), and `limit` itself: less than a quarter of a pack's own width is
    padding, and a batch captures sixteen widths up to 2048 tokens at most."""
    widths, width = [], 64
    while width < limit:
        widths.append(width)
        width += max(64, (1 << (width.bit_length() - 1)) // 4)
    return [*widths, limit]


def pack_width(tokens: int, limit: int) -> int:
    """The width of a pack of `tokens` prompt tokens: the smallest of `pack_widths(limit)` that holds them."""
    return next(width for width in pack_widths(limit) if width >= tokens)


def reused_width(tokens: int, limit: int, made: Callable[[int], bool]) -> int:
    """The width of a pack of `tokens` prompt tokens where a batch already made steps for some widths (`made`): the
    smallest made width from the pack's own (`pack_width`) up to twice it, else its own. A width's first use runs
    uncaptured (its second captures it), so a wave of prompts whose packs' sizes vary from step to step would run
    most of its steps uncaptured; reusing a made width a little wider captures it at once and replays it for the rest
    of the wave, at the cost of some padding tokens, which cost little beside a decode step's rows (against the host
    time of an uncaptured step: docs/serving.md, the first window after a restart). For a pack riding a decode step
    only: a prefill of its own takes time in proportion to its tokens, padding included, and keeps its own width."""
    widths = pack_widths(limit)
    own = next(width for width in widths if width >= tokens)
    return next((width for width in widths if own <= width <= 2 * own and made(width)), own)


def packs(lengths: list[int], limit: int) -> list[list[int]]:
    """The joiners (by prompt length, each at most `limit`) as packs of indices of at most `limit` tokens each:
    longest first, each into the first pack with room (few packs, so few replays and little tail padding)."""
    filled: list[tuple[list[int], int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for n, (members, tokens) in enumerate(filled):
            if tokens + lengths[index] <= limit:
                filled[n] = (members + [index], tokens + lengths[index])
                break
        else:
            filled.append(([index], lengths[index]))
    return [members for members, _ in filled]


def packed_prompts(prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, segments, positions), each 1 × `width`, of the prompts end to end on the host: a token's segment is its
    prompt's index (each padding token past them a segment of its own), its position its index within its prompt."""
    ids = torch.zeros((1, width), dtype=torch.long)
    segments = torch.arange(len(prompts), len(prompts) + width, dtype=torch.long)[None]
    positions = torch.zeros((1, width), dtype=torch.long)
    begin = 0
    for index, prompt in enumerate(prompts):
        end = begin + len(prompt)
        ids[0, begin:end] = torch.tensor(prompt)
        segments[0, begin:end] = index
        positions[0, begin:end] = torch.arange(len(prompt))
        begin = end
    return ids, segments, positions


def repeated(values: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """`values[i]` `counts[i]` times, end to end, as a host tensor of int64 (each packed token's row, say). Host index
    math of a joining step runs in numpy: torch's CPU `repeat_interleave` runs a parallel loop whose threads wait for
    cores for milliseconds on a busy host (beside serving's other processes, in the engine core's trace)."""
    return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64)))


def prompt_columns(lengths: Sequence[int], slot: int, cache_len: int) -> torch.Tensor:
    """The cache column of every token of prompts of `lengths` tokens (end to end) that end right before `slot`
    (counted without wrapping), in a cache of `cache_len` columns reused around its end (numpy: see `repeated`)."""
    counts = np.asarray(lengths, dtype=np.int64)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy((np.repeat(slot - counts, counts) + within) % cache_len)


def packed_context(segments: torch.Tensor, positions: torch.Tensor,
                   float_mask_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """A pack's 4-D attention mask and position ids on the segments' device, without reading them on the host: a
    token attends to the tokens of its own prompt up to itself (a padding token to itself only, so no row is empty).
    Booleans for sdpa, additive floats (`float_mask_dtype`) for eager attention."""
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    keep = (causal & (segments[0][:, None] == segments[0][None, :]))[None, None]
    if float_mask_dtype is not None:
        zero = torch.zeros((), dtype=float_mask_dtype, device=segments.device)
        keep = torch.where(keep, zero, torch.finfo(float_mask_dtype).min)
    return {"attention_mask": keep, "position_ids": positions}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied on the current stream (from pinned memory, so the host does not wait)."""
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on `device` (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)
