"""How busy each pipeline stage's GPU is while a continuous batch runs: whether the GPUs of a device map overlap.

In sampled windows of a batch's steps (WINDOW steps of every SAMPLE_EVERY), a pair of CUDA events goes around each
piece of a stage's work on its compute stream (a lane's step, a joining pack's prefill), recorded after the waits
that order it behind other stages, so the pair spans work and not waiting. Once a window's last events have happened
(`harvest` asks without waiting), each stage's busy share of it is its work's time over the span from its first work
to its last in that window: a stage kept fed by the others and by the host is busy ~100% of it, one that waits for
another stage (a pipeline that serializes) or for the host (a step the host issues slower than the GPU runs it) less.
Events of different GPUs are never compared (CUDA times events of one device only).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

SAMPLE_EVERY = 64  # steps between the starts of two sampled windows
WINDOW = 8  # steps of a sampled window: long enough to span the host's gaps between steps, short for the events
KEPT_WINDOWS = 8  # recorded windows kept for `harvest` at most (a batch nobody harvests keeps only the latest)
NOT_TIMED = contextlib.nullcontext()  # reusable: it holds no state


class BusyClock:
    """Busy time per stage in sampled windows of steps; `event` makes a timing event (torch.cuda.Event's protocol:
    record(stream), query(), elapsed_time(other) in milliseconds)."""

    def __init__(self, stages: int, event: Callable[[], Any] | None = None, every: int = SAMPLE_EVERY,
                 window: int = WINDOW) -> None:
        self.stages, self.every, self.window = stages, every, window
        self._event = event
        self.active = False
        self._open: list[list[tuple[Any, Any]]] | None = None  # the window being recorded: (start, end) per stage
        self._done: list[list[list[tuple[Any, Any]]]] = []  # recorded windows whose events may still be pending

    def begin_step(self, step: int) -> None:
        """Step `step` (from 1) is about to be issued: it is timed if it falls in a sampled window."""
        position = (step - 1) % self.every
        if position == 0:
            self._close()
            self._open = [[] for _ in range(self.stages)]
        elif position == self.window:
            self._close()
        self.active = self._open is not None and position < self.window

    def around(self, stage: int, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Time the work issued inside on `stream` (stage `stage`'s compute stream; None, a CPU: not timed). Outside
        the sampled windows this is a no-op context (it wraps every stage's step)."""
        if not self.active or stream is None or self._open is None:
            return NOT_TIMED
        return self._timed(self._open[stage], stream)

    @contextlib.contextmanager
    def _timed(self, pairs: list[tuple[Any, Any]], stream: Any) -> Iterator[None]:
        start, end = self._make(), self._make()
        start.record(stream)
        yield
        end.record(stream)
        pairs.append((start, end))

    def harvest(self) -> list[tuple[int, float, float]]:
        """(stage, busy seconds, span seconds) of each stage in every recorded window whose events have all happened
        (never waiting for the GPUs); those windows are forgotten."""
        out: list[tuple[int, float, float]] = []
        pending = []
        for window in self._done:
            if not all(end.query() for pairs in window for _, end in pairs):
                pending.append(window)
                continue
            for stage, pairs in enumerate(window):
                if pairs:
                    busy = sum(start.elapsed_time(end) for start, end in pairs) / 1000
                    span = pairs[0][0].elapsed_time(pairs[-1][1]) / 1000
                    out.append((stage, busy, max(span, busy)))
        self._done = pending
        return out

    def _close(self) -> None:
        if self._open is not None and any(self._open):
            self._done = [*self._done[-(KEPT_WINDOWS - 1):], self._open]
        self._open = None

    def _make(self) -> Any:
        if self._event is None:
            import torch

            return torch.cuda.Event(enable_timing=True)
        return self._event()
