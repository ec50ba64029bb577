"""Compiling a resident model's steps while it serves (`devmap serve --compile-beside`): a model answers as soon as its
weights are on their devices, with eager steps, while a thread of its own has its steps compiled: in a process of
their own where it can (`compile_process`), then loaded by a light warm-up, else in this process (`warm_up`, beside
the serving thread; no step captures meanwhile, in any thread, but while dynamo traces:
`graphed_step.captures_paused`); meanwhile the eager steps of its batches carry more of their joiners' prompt tokens a
step (`mixed_joins.compiling_beside`). Once they are ready the model is marked compiled, and its running batch runs
compiled steps from its next step on (`batch_run`, `ContinuousBatch.recompile`: the same rows, KV caches and tokens in
flight; each step captured at its second use), as every later batch does. A compile that fails leaves the model on
its eager steps, with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..generation.mixed_joins import compiling_beside

log = logging.getLogger("devmap.serving")

Work = Callable[[Callable[[], bool]], Any]
"""The compile itself, given `stop()`: True when it should end early (its model is being unloaded); what it returns
(where its time went) goes to `done`."""


class StepCompile:
    """One model's compile in a thread of its own; `done(result)` is called with what the compile returned once it
    succeeded (not when it failed or was stopped). `failure`: why it failed, if it did."""

    def __init__(self, model_id: str, work: Work, done: Callable[[Any], None]) -> None:
        self.model_id, self.failure = model_id, None
        self._work, self._done = work, done
        self._stop, self._ended = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"devmap-compile-{model_id}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compile to end (True if it did within `timeout` seconds)."""
        return self._ended.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """End the compile at its next step and wait for it, up to `timeout` seconds (its model is about to be
        freed, or the service to end)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            with compiling_beside():  # the batches' eager steps meanwhile carry more prompt tokens
                result = self._work(self._stop.is_set)
        except Exception as exc:
            self.failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("%s: decode steps stay eager (captured): compiling them failed: %s", self.model_id,
                        self.failure)
        else:
            if not self._stop.is_set():
                seconds = time.perf_counter() - started
                self._done(result)
                log.info("%s: compiled steps ready after %.1f s; its batches continue on them", self.model_id,
                         seconds)
        finally:
            self._ended.set()
