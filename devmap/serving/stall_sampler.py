"""Where the engine's loop thread sat while a step was slow, and what ran beside it, for the debug log.

A slow step's time says how long; where it went is a question for a profiler, which nobody runs on a service when
the stall happens. Here a thread samples the loop thread's innermost Python frames every INTERVAL and keeps the runs
of samples in one place (a call into torch that built something at its first call, a kernel's compile, a lock); a
slow step's log line names the longest run within it. A call that holds the interpreter keeps this thread from
sampling until it lets go: that time counts toward the place sampled last before it (the call's caller where it
began within a sample's interval). A step slowed everywhere at once (no place holds it long) is slowed by something
beside it: the sampler also keeps where the process's other threads were busy (not waiting in `threading`, `queue`
or `selectors`), and the line names the one sampled most within the step. It runs only while the debug log is on
(it takes the interpreter briefly every INTERVAL).

CPython's `sys._current_frames` is how one thread sees another's frames; this module is the project's one reader of it
(the sampler, and `thread_frame` for the stack-sampling probes in benchmarks/probes).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from types import FrameType

INTERVAL = 0.02  # seconds between two samples
KEPT_RUNS = 512  # runs kept: a slow step's runs are a few seconds old at most when its line is written
KEPT_BESIDE = 2048  # samples of other threads' busy places kept, for the same reason
WAITING = frozenset({"threading.py", "queue.py", "selectors.py", "connection.py"})  # a thread sampled in these waits


def thread_frame(ident: int) -> FrameType | None:
    """The innermost Python frame thread `ident` runs now; None where it has ended."""
    return sys._current_frames().get(ident)


def place(frame: FrameType, depth: int = 2) -> str:
    """`frame` and its callers, `depth` of them, as `file.py:line in function` joined by ' < '."""
    parts = []
    while frame is not None and len(parts) < depth:
        parts.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


class StallSampler:
    """Samples thread `ident`'s place every `interval` seconds in a daemon thread of its own, until `close`."""

    def __init__(self, ident: int, interval: float = INTERVAL) -> None:
        self.ident, self.interval = ident, interval
        self._runs: collections.deque[tuple[float, float, str]] = collections.deque(maxlen=KEPT_RUNS)
        self._beside: collections.deque[tuple[float, str]] = collections.deque(maxlen=KEPT_BESIDE)
        self._current: tuple[float, str] | None = None  # the run going on: its start and place
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="devmap-stall-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = threading.get_ident()
        while not self._closed.wait(self.interval):
            frames = sys._current_frames()
            now = time.perf_counter()
            frame = frames.pop(self.ident, None)
            where = place(frame) if frame is not None else "(the thread has ended)"
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            busy = [f"{names.get(ident, ident)} at {place(other)}" for ident, other in frames.items()
                    if ident != me and os.path.basename(other.f_code.co_filename) not in WAITING]
            del frame, frames
            with self._lock:
                self._beside.extend((now, text) for text in busy)
                if self._current is not None and self._current[1] == where:
                    continue
                if self._current is not None:
                    self._runs.append((self._current[0], now, self._current[1]))
                self._current = (now, where)

    def longest(self, since: float, until: float) -> tuple[float, str] | None:
        """The longest run of samples in one place between `since` and `until` (perf_counter seconds), clipped to
        them: its seconds and place; None where no run fell between them."""
        with self._lock:
            runs = list(self._runs)
            if self._current is not None:  # going on until now, as far as anyone knows
                runs.append((self._current[0], time.perf_counter(), self._current[1]))
        best = None
        for start, end, where in runs:
            seconds = min(end, until) - max(start, since)
            if seconds > 0 and (best is None or seconds > best[0]):
                best = (seconds, where)
        return best

    def beside(self, since: float, until: float) -> tuple[float, str] | None:
        """The other thread's busy place sampled most often between `since` and `until`: its samples' seconds (count
        times the interval) and the thread's name and place; None where no other thread was sampled busy then."""
        with self._lock:
            counts = collections.Counter(text for at, text in self._beside if since <= at <= until)
        if not counts:
            return None
        text, count = counts.most_common(1)[0]
        return count * self.interval, text

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
