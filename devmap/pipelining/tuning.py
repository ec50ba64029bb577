"""Find the best number of micro-batches for a pipeline by measuring training steps, as the tutorial says to do by
hand."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import UsageError
from .pipe import Pipeline
from .refine import measure

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
        seconds = measure(pipe, sample, steps, warmup)
        table.append({"chunks": chunks, "micro_batch": -(-sample.shape[0] // chunks), "seconds": seconds,
                      "samples_per_s": sample.shape[0] / seconds, "graph_failures": list(pipe.graph_failures)})
        del pipe
        if progress is not None:
            progress()
    best = min(table, key=lambda row: row["seconds"])
    return TuneResult(batch_size=sample.shape[0], best_chunks=best["chunks"], best_seconds=best["seconds"],
                      table=table)


