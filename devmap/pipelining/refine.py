"""Move a placed model's stage boundaries by measuring whole training steps (what balance="measure" does)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .pipe import Pipeline, from_placement


def _sync(pipe: Pipeline) -> None:
    for device in set(pipe.devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def train_step(pipe: Pipeline, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step: forward, mean-squared output as the loss, backward, SGD."""
    optimizer.zero_grad(set_to_none=True)
    pipe(x).float().square().mean().backward()
    optimizer.step()


def measure(pipe: Pipeline, sample: torch.Tensor, steps: int, warmup: int) -> float:
    """Seconds per training step of `pipe` on `sample` (zero learning rate, buffers restored after)."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)
    saved = [b.detach().clone() for b in pipe.buffers()]
    pipe.train().prepare(sample)
    for _ in range(warmup):
        train_step(pipe, sample, optimizer)
    _sync(pipe)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(pipe, sample, optimizer)
    _sync(pipe)
    with torch.no_grad():
        for buffer, value in zip(pipe.buffers(), saved):
            buffer.copy_(value)
    for p in pipe.parameters():
        p.grad = None
    return (time.perf_counter() - start) / steps


def refine_split(model: torch.nn.Module, sample: torch.Tensor, chunks: int, steps: int = 3,
                 warmup: int = 2) -> dict[str, Any]:
    """Move each stage boundary of a placed model by one block either way while a measured training step gets
    faster (per-block profiles miss what blocks cost together); returns the times tried and the block split kept."""
    from .stages import block_devices, blocks_of

    blocks = blocks_of(model)
    names = [n for n, _ in blocks]

    def apply(devices: list[torch.device]) -> None:
        for (_, block), device in zip(blocks, devices):
            block.to(device)
        model.hf_device_map = {n: (d.index if d.type == "cuda" else d.type)
                               for n, d in zip(names, devices) if n != "flatten"}

    def cost(devices: list[torch.device]) -> float:
        apply(devices)
        pipe = from_placement(model, chunks=chunks)
        try:
            return measure(pipe, sample, steps, warmup)
        finally:
            del pipe

    current = block_devices(model, blocks)
    best = cost(current)
    tried = [{"boundaries": _boundaries(names, current), "seconds": best}]
    improved = True
    while improved:
        improved = False
        for k in [k for k in range(len(current) - 1) if current[k] != current[k + 1]]:
            for candidate in (current[:k] + [current[k + 1]] + current[k + 1:],   # block k moves right
                              current[:k + 1] + [current[k]] + current[k + 2:]):  # block k+1 moves left
                if len(set(candidate)) < len(set(current)):
                    continue  # a stage would vanish
                seconds = cost(candidate)
                tried.append({"boundaries": _boundaries(names, candidate), "seconds": seconds})
                if seconds < best * 0.99:
                    best, current, improved = seconds, candidate, True
                    break
            if improved:
                break
    apply(current)
    return {"seconds": best, "boundaries": _boundaries(names, current), "tried": tried}


def _boundaries(names: list[str], devices: list[torch.device]) -> list[str]:
    """The last block of every stage but the last."""
    return [names[k] for k in range(len(devices) - 1) if devices[k] != devices[k + 1]]


def refine_cut(model: torch.nn.Module, sample: torch.Tensor, chunks: int, steps: int = 3,
               warmup: int = 2) -> dict[str, Any]:
    """At each stage boundary of a model placed by whole blocks, try cutting the residual block on either side
    at each of its cut points (the head stays with the earlier stage, the tail with the later); keep a cut
    whose measured training step is faster. Whole-block boundaries are too coarse to balance ResNet50's
    two stages."""
    from .residual_parts import cuts_of, split_residual, unit_name
    from .stages import apply_units, whole_block_devices

    blocks, devices = whole_block_devices(model)

    def cost(units: list, unit_devices: list[torch.device]) -> float:
        apply_units(model, units, unit_devices)
        pipe = from_placement(model, chunks=chunks)
        try:
            return measure(pipe, sample, steps, warmup)
        finally:
            del pipe

    best_units, best_devices = list(blocks), list(devices)
    best = cost(best_units, best_devices)
    tried: list[dict[str, Any]] = [{"cut": None, "seconds": best}]
    for k in [k for k in range(len(blocks) - 1) if devices[k] != devices[k + 1]]:
        start_units, start_devices = list(best_units), list(best_devices)
        offset = len(start_units) - len(blocks)  # units added by cuts at earlier boundaries
        for index in (k, k + 1):
            name, block = blocks[index]
            if start_units[index + offset][0] != name:
                continue  # already cut at an earlier boundary
            for cut in cuts_of(block):
                head, tail = split_residual(block, cut)  # type: ignore[misc]
                at = index + offset
                units = start_units[:at] + [(unit_name(name, "head", block, cut), head),
                                            (unit_name(name, "tail", block, cut), tail)] + start_units[at + 1:]
                unit_devices = start_devices[:at] + [devices[k], devices[k + 1]] + start_devices[at + 1:]
                seconds = cost(units, unit_devices)
                tried.append({"cut": units[at][0], "seconds": seconds})
                if seconds < best * 0.99:
                    best, best_units, best_devices = seconds, units, unit_devices
    apply_units(model, best_units, best_devices)
    return {"seconds": best, "cut": [n for n, _ in best_units if n.endswith("]")], "tried": tried}
