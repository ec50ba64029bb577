"""Where a model's load went, phase by phase (planning, reading the weights onto their devices, preparing its
products and tokenizer, compiling and warming up its steps): logged, in the model's description, and in `/metrics`
(`devmap_model_load_seconds{model, phase}`), so that a slow start shows its cause."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

PHASES = ("plan", "weights", "prepare", "compile")  # in load order; "compile" includes capturing and warming up


class LoadPhases:
    """Seconds per phase of one load, as `with phases.timed("weights"): ...` measures them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started

    def summary(self) -> str:
        """"plan 0.41 s, weights 1.12 s, ..." in load order."""
        return ", ".join(f"{phase} {self.seconds[phase]:.2f} s" for phase in PHASES if phase in self.seconds)
