"""Python's cyclic garbage collector as the service sees it: each long collection (it holds every thread, the
engine's issuing thread included) logged at debug and counted in a metric."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

log = logging.getLogger("devmap.serving")


def watch_gc_pauses(threshold: float = 0.02, observe: Callable[[float], None] | None = None) -> Callable[[], None]:
    """Log collections of `threshold` seconds or more (and hand every collection's seconds to `observe`); returns
    the function that stops watching."""
    started: dict[str, float] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["at"] = time.perf_counter()
            return
        if "at" not in started:
            return
        took = time.perf_counter() - started.pop("at")
        if observe is not None:
            observe(took)
        if took >= threshold:
            log.debug("python's garbage collector (generation %d) held every thread for %.0f ms (%d objects freed)",
                      info.get("generation", -1), 1000 * took, info.get("collected", 0))

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)
