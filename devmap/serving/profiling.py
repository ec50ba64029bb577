"""Traces of the engine core under live traffic, on demand: `devmap serve --profile-dir DIR`, then `POST
/start_profile` and `POST /stop_profile`, as vLLM's. torch.profiler records the core's own thread (the one that
issues every step: its host-side ops and CUDA API calls, and the GPUs' kernels), from the step after the start to the
step after the stop, so that where the engine loop spends its time between steps can be read off a real load: a
Chrome trace (`chrome://tracing`, Perfetto) and a table of the ops and CUDA calls by their own host time.

The HTTP side asks; the core's loop starts and stops the profiler itself between two steps (`poll`), since the
profiler records the thread that enters it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from .errors import ServiceError

WAIT_S = 120.0  # how long a start or stop waits for the core's loop to act (a step, a load, writing the trace)


class ProfilingOff(ServiceError):
    status = 404


class CoreProfiler:
    """The core's profiler: `start`/`stop` from any thread, `poll` on the core's loop between steps."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self._lock = threading.Lock()
        self._wanted = False
        self._profile: Any = None  # the running torch.profiler.profile, on the core's thread
        self._acted = threading.Event()
        self._written: dict[str, str] = {}
        self._error: BaseException | None = None

    def start(self) -> dict[str, Any]:
        """Ask the core to start recording; returns once it records."""
        with self._lock:
            self._check_on()
            if self._wanted:
                raise ServiceError("a profile is already recording; POST /stop_profile ends it")
            self._acted.clear()
            self._wanted = True
        self._wait("start")
        return {"profiling": True, "folder": str(self.folder)}

    def stop(self) -> dict[str, Any]:
        """Ask the core to stop recording and write the trace; returns the files written."""
        with self._lock:
            self._check_on()
            if not self._wanted:
                raise ServiceError("no profile is recording; POST /start_profile starts one")
            self._acted.clear()
            self._wanted = False
        self._wait("stop")
        return {"profiling": False, **self._written}

    def poll(self) -> None:
        """On the core's loop, between steps: start or stop the profiler as asked."""
        if self._wanted == (self._profile is not None):
            return
        try:
            if self._wanted:
                self._profile = _new_profile()
                self._profile.__enter__()
            else:
                profile, self._profile = self._profile, None
                profile.__exit__(None, None, None)
                self._written = self._write(profile)
            self._error = None
        except Exception as exc:  # noqa: BLE001 - told to the caller of start/stop; the core goes on
            self._profile, self._wanted, self._error = None, False, exc
        self._acted.set()

    def close(self) -> None:
        """The core is stopping: a profile still recording is ended and written."""
        self._wanted = False
        self.poll()

    def _check_on(self) -> None:
        if self.folder is None:
            raise ProfilingOff("profiling is off: start the service with --profile-dir DIR")

    def _wait(self, what: str) -> None:
        if not self._acted.wait(WAIT_S):
            raise ServiceError(f"the engine core did not {what} the profile within {WAIT_S:.0f} s (is it loading a "
                               "model?); try again")
        if self._error is not None:
            raise ServiceError(f"the profiler could not {what}: {type(self._error).__name__}: {self._error}")

    def _write(self, profile: Any) -> dict[str, str]:
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"devmap-core-{time.strftime('%Y%m%d-%H%M%S')}"
        trace, table = stem.with_suffix(".trace.json"), stem.with_suffix(".ops.txt")
        profile.export_chrome_trace(str(trace))
        averages = profile.key_averages()
        table.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=80) + "\n")
        return {"trace": str(trace), "ops": str(table)}


def _new_profile() -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities)
