"""How often the interpreter passes between threads while a compile or a load shares the engine core's process with
serving.

The engine core's process runs its batches in one thread while another compiles (`--compile-beside`) or loads a model
(over HTTP, beside those that serve). A step gives the interpreter up at every call into torch (each GPU call, copy
and event), and dynamo's tracing or the load in the other thread holds it until the next forced switch: at Python's
default interval (5 ms) a step that takes the interpreter back a few dozen times waits that many intervals. While a
compile or a load runs (`warm_up`, `ModelRegistry.load`) the interval is SHARED (50 µs), so the serving thread gets it
back within microseconds; the compile or load, yielding more often, takes longer while something serves beside it
(nothing changes when nothing does: a switch is forced only when another thread waits). docs/serving.md has the
measurements (`benchmarks/probes/gil_switch.py`, `benchmarks/serve_load.py`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

SHARED = 50e-6  # seconds: the switch interval while a compile runs

_lock = threading.Lock()
_compiles = 0  # compiles running now, in any thread
_before = 0.0  # the interval before the first of them


@contextlib.contextmanager
def switching_often() -> Iterator[None]:
    """Inside (any thread, nested or overlapping), the switch interval is at most SHARED; the last to leave puts the
    interval from before the first back."""
    global _compiles, _before
    with _lock:
        if _compiles == 0:
            _before = sys.getswitchinterval()
            sys.setswitchinterval(min(_before, SHARED))
        _compiles += 1
    try:
        yield
    finally:
        with _lock:
            _compiles -= 1
            if _compiles == 0:
                sys.setswitchinterval(_before)
