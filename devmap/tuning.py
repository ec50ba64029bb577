"""Find the best number of micro-batches for a pipeline by measuring training steps, as the tutorial says to do by hand."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from .errors import UsageError
from .pipelining import Pipeline

DEFAULT_CHUNKS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class TuneResult:
    """Seconds per training step for each candidate, and the best one."""

    batch_size: int
    best_chunks: int
    best_seconds: float
    table: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(pipe: Pipeline) -> None:
    for device in set(pipe.devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def train_step(pipe: Pipeline, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step: forward, mean-squared output as the loss, backward, SGD."""
    optimizer.zero_grad(set_to_none=True)
    pipe(x).float().square().mean().backward()
    optimizer.step()


def tune(
    build: Callable[[int], Pipeline],
    sample: torch.Tensor,
    candidates: Sequence[int] = DEFAULT_CHUNKS,
    steps: int = 5,
    warmup: int = 2,
    progress: Callable[[], None] | None = None,
) -> TuneResult:
    """Time `steps` training steps of `build(chunks)` on `sample` for each candidate chunk count.

    Candidates above the batch size are skipped (they would make micro-batches of one row or fewer).
    The pipelines share the model's parameters, so the steps use a zero learning rate: tuning does
    not change the weights.
    """
    usable = sorted({c for c in candidates if 1 <= c <= sample.shape[0]})
    if not usable:
        raise UsageError(f"no candidate chunk count fits a batch of {sample.shape[0]}; give counts between 1 and it")
    if steps < 1 or warmup < 0:
        raise UsageError("steps must be at least 1 and warmup non-negative")
    table = []
    for chunks in usable:
        pipe = build(chunks)
        seconds = _measure(pipe, sample, steps, warmup)
        table.append({"chunks": chunks, "micro_batch": -(-sample.shape[0] // chunks), "seconds": seconds,
                      "samples_per_s": sample.shape[0] / seconds, "graph_failures": list(pipe.graph_failures)})
        del pipe
        if progress is not None:
            progress()
    best = min(table, key=lambda row: row["seconds"])
    return TuneResult(batch_size=sample.shape[0], best_chunks=best["chunks"], best_seconds=best["seconds"],
                      table=table)


def _measure(pipe: Pipeline, sample: torch.Tensor, steps: int, warmup: int) -> float:
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
    from .pipelining import pipeline
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
        pipe = pipeline(model, chunks=chunks)
        try:
            return _measure(pipe, sample, steps, warmup)
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
    between its head and tail (the head stays with the earlier stage); keep a cut whose measured training step is
    faster. Whole-block boundaries are too coarse to balance ResNet50's two stages."""
    from .pipelining import pipeline
    from .residual_parts import head_tail_names
    from .stages import apply_units, merge_units, split_units, whole_block_devices

    blocks, devices = whole_block_devices(model)
    units = split_units(blocks)
    by_block = {name: device for (name, _), device in zip(blocks, devices)}
    current = [by_block[name.split("[")[0]] for name, _ in units]

    def cost(unit_devices: list[torch.device]) -> float:
        apply_units(model, *merge_units(units, unit_devices, blocks))
        pipe = pipeline(model, chunks=chunks)
        try:
            return _measure(pipe, sample, steps, warmup)
        finally:
            del pipe

    best = cost(current)
    tried = [{"cut": None, "seconds": best}]
    names = [name for name, _ in blocks]
    for k in [k for k in range(len(blocks) - 1) if devices[k] != devices[k + 1]]:
        start = current.copy()
        for index, move_to in ((k, devices[k + 1]), (k + 1, devices[k])):
            if head_tail_names(blocks[index][1]) is None:
                continue
            candidate = start.copy()
            tail = [u for u, (name, _) in enumerate(units) if name == f"{names[index]}[tail]"][0]
            head = tail - 1
            if index == k:  # the tail of the earlier stage's last block moves on
                candidate[tail] = move_to
            else:  # the head of the later stage's first block moves back
                candidate[head] = move_to
            seconds = cost(candidate)
            tried.append({"cut": names[index], "seconds": seconds})
            if seconds < best * 0.99:
                best, current = seconds, candidate
    apply_units(model, *merge_units(units, current, blocks))
    return {"seconds": best, "cut": _cut_names(units, current), "tried": tried}


def _cut_names(units: list, devices: list[torch.device]) -> list[str]:
    """The blocks whose head and tail ended on different devices."""
    return [units[u][0].split("[")[0] for u in range(len(units) - 1)
            if units[u][0].endswith("[head]") and devices[u] != devices[u + 1]]
