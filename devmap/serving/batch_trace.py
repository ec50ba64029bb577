"""What the engine loop measures about itself: its time per phase (Prometheus counters) and, for the debug log,
each batch's start, its joiners' admission and the slowest first token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .jobs import Job
from .metrics import EngineMetrics
from .stall_sampler import StallSampler

log = logging.getLogger("devmap.serving")
SLOW_FIRST_TOKEN = 0.25  # seconds: a request slower than this to its first token is logged with its phases (debug)
SLOW_STEP = 0.1  # seconds: a step slower than this is logged with its phases (debug)


def allocator_retries() -> int:
    """How often torch's CUDA allocator has freed its cached blocks to retry an allocation that failed, in this
    process so far, on every GPU (0 without CUDA)."""
    import torch

    if not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_stats(index).get("num_alloc_retries", 0) for index in range(torch.cuda.device_count()))


class PhaseClock:
    """Adds the time since the last mark to the engine's per-phase seconds (one counter per phase)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.counters = {phase: metrics.engine_seconds.labels(phase=phase)
                         for phase in ("launch", "collect", "hand_back", "schedule", "idle")}
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.counters[phase].inc(now - self.last)
        self.last = now


@dataclass
class BatchTrace:
    """A batch's timings for the debug log: when it started, when each joiner was taken in (and how many rows were
    free then), the slowest wait for a first token; where the loop thread sat longest in a slow step and what ran
    busiest beside it (`sampler`, while the debug log is on)."""

    started: float
    rows: int
    sampler: StallSampler | None = None
    slowest: float = 0.0
    admitted: dict[int, tuple[float, int]] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.admitted = {}

    def step(self, began: float, launched: float, joining: int, compiled: bool) -> None:
        """A step issued from `began` to `launched` (perf_counter seconds) and collected until now, with `joining`
        prompts in it, on compiled steps or not: logged (debug) where it took longer than SLOW_STEP."""
        now = time.perf_counter()
        if now - began > SLOW_STEP and log.isEnabledFor(logging.DEBUG):
            log.debug("slow step (%.0f ms: issued in %.0f, collected in %.0f) with %d prompts joining, %s steps, "
                      "%.0f ms into the batch%s", 1000 * (now - began), 1000 * (launched - began),
                      1000 * (now - launched), joining, "compiled" if compiled else "eager",
                      1000 * (now - self.started), self._where(began, now))

    def _where(self, began: float, now: float) -> str:
        """Where a slow step's time went, as far as the sampler saw it (empty without one)."""
        if self.sampler is None:
            return ""
        text = f"; the loop thread on a core {1000 * self.sampler.on_cpu(began, now):.0f} ms"
        if longest := self.sampler.longest(began, now):
            text += f"; longest in one place {1000 * longest[0]:.0f} ms: {longest[1]}"
        if beside := self.sampler.beside(began, now):
            text += f"; ran most beside it ({1000 * beside[0]:.0f} ms on a core): {beside[1]}"
        if retries := allocator_retries():
            text += f"; the GPU allocator freed its cache and retried {retries} times so far"
        return text

    def first_token(self, job: Job) -> None:
        now = time.perf_counter()
        self.slowest = max(self.slowest, now - job.arrived)
        taken, free = self.admitted.pop(id(job), (self.started, self.rows))
        if now - job.arrived > SLOW_FIRST_TOKEN and log.isEnabledFor(logging.DEBUG):
            log.debug("slow first token (%.0f ms): a %d-token prompt waited %.0f ms to join (%d rows free then; "
                      "%.0f ms into the batch), then %.0f ms to its first token", 1000 * (now - job.arrived),
                      len(job.prompt_ids) + len(job.generated), 1000 * (taken - job.arrived), free,
                      1000 * (taken - self.started), 1000 * (now - taken))
