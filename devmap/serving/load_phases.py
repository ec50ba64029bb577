"""Where a model's load went, phase by phase (planning, reading the weights onto their devices, preparing its
products and tokenizer, compiling its steps, capturing them as CUDA graphs, and the rest of warming them up): logged,
in the model's description, and in `/metrics` (`devmap_model_load_seconds{model, phase}`), with how many of the
compiled graphs came from the compile cache, so that a slow start shows its cause."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, NamedTuple

PHASES = ("plan", "weights", "prepare", "compile", "capture", "warm_up")  # in load order


class CompiledGraphs(NamedTuple):
    """The graphs a load compiled (torch.compile's FX graphs), and how many of them came from the compile cache."""

    total: int
    from_cache: int

    def describe(self) -> str:
        """"5 graphs, all from the compile cache" and the like."""
        if not self.total:
            return "no graph compiled"
        cached = ("all" if self.from_cache == self.total else str(self.from_cache)) if self.from_cache else "none"
        return f"{self.total} graph{'s' if self.total != 1 else ''}, {cached} from the compile cache"


class LoadPhases:
    """Seconds per phase of one load, as `with phases.timed("weights"): ...` measures them (or `add` records), and
    the graphs its compile made (`graphs`, None where nothing compiled)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.graphs: CompiledGraphs | None = None

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def summary(self) -> str:
        """`phases_text` of this load, in load order."""
        return phases_text({phase: self.seconds[phase] for phase in PHASES if phase in self.seconds}, self.graphs, 2)


def phases_text(seconds: dict[str, float], graphs: CompiledGraphs | None, digits: int = 1) -> str:
    """"plan 0.41 s, weights 1.12 s, ..., compile 9.5 s (5 graphs, all from the compile cache), ...": a load's phases
    (`seconds`, in their order) and the graphs its compile made."""
    def one(phase: str, spent: float) -> str:
        made = f" ({graphs.describe()})" if phase == "compile" and graphs else ""
        return f"{phase} {spent:.{digits}f} s{made}"

    return ", ".join(one(phase, spent) for phase, spent in seconds.items())
