"""Where the engine's loop thread sat while a step was slow, and what ran beside it, for the debug log.

A slow step's time says how long; where it went is a question for a profiler, which nobody runs on a service when
the stall happens. Here a thread samples the loop thread's innermost Python frames every INTERVAL and keeps the runs
of samples in one place (a call into torch that built something at its first call, a kernel's compile, a lock); a
slow step's log line names the longest run within it. A call that holds the interpreter keeps this thread from
sampling until it lets go: that time counts toward the place sampled last before it (the call's caller where it
began within a sample's interval). A step slowed everywhere at once (no place holds it long) waits for something
else: the sampler also reads each thread's CPU time (Linux's `/proc/self/task/<id>/schedstat`, which a thread that
has ended just lacks; elsewhere none is read), so the line says how much of the step the loop thread ran on a core
(little: it waited, for the interpreter, a lock, the GPU or the allocator) and which other thread of the process ran
most meanwhile, with the place it was sampled at most. It runs only while the debug log is on (it takes the
interpreter briefly every INTERVAL).

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
KEPT_SAMPLES = 4096  # samples of every thread's CPU time kept, for the same reason


def cpu_seconds(native_id: int | None) -> float | None:
    """The CPU time so far of this process's thread whose kernel id is `native_id` (`Thread.native_id`), in seconds;
    None where the platform cannot say, or the thread has ended."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as stats:
            return int(stats.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


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
        # each sample: its time, the loop thread's CPU seconds since the last one, and each other thread that ran
        # meanwhile (its name, its place, its CPU seconds since the last sample)
        self._samples: collections.deque[tuple[float, float, list[tuple[str, str, float]]]] = \
            collections.deque(maxlen=KEPT_SAMPLES)
        self._cpu: dict[int, float] = {}  # each thread's CPU seconds at the last sample
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
            frames.pop(me, None)
            where = place(frame) if frame is not None else "(the thread has ended)"
            threads = {thread.ident: thread for thread in threading.enumerate()}
            loop = self._ran(self.ident, threads)
            beside = [(threads[ident].name if ident in threads else str(ident), place(other), ran)
                      for ident, other in frames.items() if (ran := self._ran(ident, threads)) > 0]
            for ident in self._cpu.keys() - frames.keys() - {self.ident}:  # ended threads
                del self._cpu[ident]
            del frame, frames
            with self._lock:
                self._samples.append((now, loop, beside))
                if self._current is not None and self._current[1] == where:
                    continue
                if self._current is not None:
                    self._runs.append((self._current[0], now, self._current[1]))
                self._current = (now, where)

    def _ran(self, ident: int, threads: dict[int, threading.Thread]) -> float:
        """Thread `ident`'s CPU seconds since the last sample (0 at its first, or where it cannot be read)."""
        now = cpu_seconds(threads[ident].native_id if ident in threads else None)
        if now is None:
            return 0.0
        before = self._cpu.get(ident, now)
        self._cpu[ident] = now
        return now - before

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

    def on_cpu(self, since: float, until: float) -> float:
        """The loop thread's CPU seconds in the samples between `since` and `until`."""
        with self._lock:
            return sum(loop for at, loop, _ in self._samples if since < at <= until)

    def beside(self, since: float, until: float) -> tuple[float, str] | None:
        """The other thread that ran most between `since` and `until`: its CPU seconds then, and its name with the
        place it was sampled at most; None where no other thread ran then."""
        seconds: collections.Counter[str] = collections.Counter()
        places: collections.Counter[tuple[str, str]] = collections.Counter()
        with self._lock:
            for at, _, beside in self._samples:
                if since < at <= until:
                    for name, where, ran in beside:
                        seconds[name] += ran
                        places[name, where] += 1
        if not seconds:
            return None
        name, ran = seconds.most_common(1)[0]
        where = max((at for thread, at in places if thread == name), key=lambda at: places[name, at])
        return ran, f"{name} at {where}"

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
