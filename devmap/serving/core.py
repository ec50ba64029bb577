"""The engine core: the resident models and the loop that runs continuous batches on them, at the level of token
ids. Built as vLLM's engine core is: each turn of its loop asks the scheduler (`scheduler.py`, pure policy) who runs
next and runs that batch step by step (`batch_run.py`: joins, hand-backs, a failed step's isolation), handing the
tokens that came back to `deliver` as one list of `TokenOutput` per step (`outputs.py`). The core applies the token
stop rule (an end-of-sequence token, or the request's token budget); text, stop strings and HTTP live on the API
side (`engine.py`), which may be another process (`core_client.py`), so that no request's Python work holds this
loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

from ..generation.row_types import StepFailed
from .batch_run import Batches, BatchRunner, ModelBatches, failure_for
from .errors import EngineGone, GenerationFailed, ServiceError
from .gc_pauses import watch_gc_pauses
from .jobs import Job
from .limits import EngineLimits
from .load_phases import PHASES
from .metrics import EngineMetrics
from .outputs import Deliver, StepOutputs
from .profiling import CoreProfiler
from .registry import ModelRegistry
from .scheduler import Scheduler, Start, batch_shape

log = logging.getLogger("devmap.serving")

CLOSE_COMPILE_SECONDS = 30.0  # how long closing waits for a compile beside serving to reach its next step

# the core's methods the API may call
CONTROL = ("models", "describe", "load", "unload", "render_metrics", "record_startup", "start_profile", "stop_profile")


class EngineCore:
    """Requests in (`add`, `abort`), tokens out (`deliver`), one worker thread between. `start()` before use,
    `close()` to finish the queued and running requests and stop."""

    def __init__(self, registry: ModelRegistry, limits: EngineLimits, deliver: Deliver,
                 unloaded: Callable[[str], None] = lambda model_id: None, batches: Batches | None = None) -> None:
        self.registry, self.limits = registry, limits
        self.unloaded = unloaded
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(limits.scheduling())  # the worker's: requests taken off the queue
        self.outputs = StepOutputs(deliver)  # its `live` index: every request not yet ended (abort finds them)
        self.profiler = CoreProfiler(limits.profile_dir)  # started and stopped by the worker, between steps
        self.runner = BatchRunner(self.scheduler, limits, self.metrics, self.outputs, self._pull,
                                  batches or ModelBatches(limits))
        self._queue: queue.Queue[Job] = queue.Queue()
        self._closing = threading.Event()
        self._worker: threading.Thread | None = None
        self._unwatch_gc: Callable[[], None] = lambda: None  # set while the worker runs
        self._last_done = 0.0  # perf_counter when the last batch ended
        self._early: dict[Path, Future[dict[str, Any]]] = {}  # `load_early`'s loads the API has not asked for yet
        self._early_loads: threading.Thread | None = None

    def start(self) -> None:
        if self._worker is None:
            self._unwatch_gc = watch_gc_pauses(observe=self.metrics.gc_pauses.observe)
            self._worker = threading.Thread(target=self._run, name="devmap-engine-core", daemon=True)
            self._worker.start()

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests, finish the queued and running ones, stop the worker."""
        self._closing.set()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker = None
            self._unwatch_gc()
        self.runner.close()
        if self._early_loads is not None:  # the load in flight ends (a process must not end under it), no more start
            self._early_loads.join(timeout)
        for resident in self.registry.all():  # a compile beside serving ends at its next step
            if resident.compiling is not None:
                resident.compiling.stop(CLOSE_COMPILE_SECONDS)

    def add(self, job: Job) -> None:
        """Queue a request (any thread). Its model is looked up when it starts: a model unloaded meanwhile ends it
        with a 404 in its output."""
        with self.outputs.lock:
            self.outputs.live[job.id] = job
        self._queue.put(job)

    def abort(self, request_id: int) -> None:
        """The request's client went away or a stop string ended its text (any thread): its row is freed at the
        next step; nothing more is delivered for it."""
        with self.outputs.lock:
            job = self.outputs.live.get(request_id)
        if job is not None:
            job.cancelled.set()

    # -- control: what the API asks of the models (`CONTROL` names the calls another process may make) ----------

    def models(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.registry.all()]

    def describe(self, model_id: str) -> dict[str, Any]:
        return self.registry.get(model_id).describe()

    def load(self, name: str, model_id: str | None = None, device_map: Any = None, max_memory: Any = None,
             dtype: str | None = None, under_root: bool = True) -> dict[str, Any]:
        """Load a model (a directory under the model root, or any path with `under_root=False`: the service's own
        command line); its description with its plan and load report."""
        path = self.registry.under_root(name) if under_root else Path(name).expanduser().resolve()
        plain = not under_root and (model_id, device_map, max_memory, dtype) == (None, None, None, None)
        early = self._early.pop(path, None) if plain else None
        if early is not None and not early.cancelled():  # loading since the core started (`load_early`)
            return early.result()  # its description, or its error
        return self._load(path, model_id, device_map, max_memory, dtype)

    def load_early(self, paths: Sequence[str | Path]) -> None:
        """Start loading the service's own models (its command line's directories) now, one after another in a
        thread of their own, as `load(path, under_root=False)` would: the API's process asks for them once its own
        imports are done, and its `load` of each then waits for this one instead of starting it. A failed load ends
        the ones after it (the service stops at the first that fails), and so does `close`."""
        # a directory named twice loads once; the API's second load of it says it is loaded already
        pending: dict[Path, Future[dict[str, Any]]] = {Path(path).expanduser().resolve(): Future() for path in paths}
        self._early.update(pending)

        def run() -> None:
            failed = False
            for path, future in pending.items():
                if failed or self._closing.is_set():
                    future.cancel()
                    continue
                try:
                    future.set_result(self._load(path))
                except BaseException as exc:  # noqa: BLE001 - the API's load of this path raises it
                    failed = True
                    future.set_exception(exc)

        self._early_loads = threading.Thread(target=run, name="devmap-early-loads", daemon=True)
        self._early_loads.start()

    def _load(self, path: Path, model_id: str | None = None, device_map: Any = None, max_memory: Any = None,
              dtype: str | None = None) -> dict[str, Any]:
        resident = self.registry.load(path, model_id, device_map, max_memory, dtype)
        self.metrics.models.set(len(self.registry.all()))
        return {**resident.describe(), "plan": resident.model.devmap_plan.to_dict(), "load_report": resident.report}

    def unload(self, model_id: str) -> None:
        """Take no new work for the model, let its requests finish within the drain bound (`unload_drain`: its
        batch ends the rest), then free it."""
        self.registry.unload(model_id, self.limits.unload_drain)
        self.metrics.models.set(len(self.registry.all()))
        for phase in PHASES:
            with contextlib.suppress(KeyError):
                self.metrics.load_seconds.remove(model_id, phase)
        for source in ("cache", "new"):
            with contextlib.suppress(KeyError):
                self.metrics.compiled_graphs.remove(model_id, source)
        self.unloaded(model_id)

    def render_metrics(self) -> bytes:
        for resident in self.registry.all():  # a compile beside serving adds its phases when it ends
            for phase, seconds in dict(resident.load_seconds).items():
                self.metrics.load_seconds.labels(model=resident.id, phase=phase).set(seconds)
            graphs = resident.compiled_graphs
            if graphs is not None:
                shown = self.metrics.compiled_graphs
                shown.labels(model=resident.id, source="cache").set(graphs.from_cache)
                shown.labels(model=resident.id, source="new").set(graphs.total - graphs.from_cache)
        return self.metrics.render(self.registry.planned())

    def record_startup(self, phase: str, seconds: float) -> None:
        """One phase of the service's start, measured outside the core (`devmap serve`'s own imports, its command
        line's loads), beside the core's own (`core_process`) in `devmap_startup_seconds`."""
        self.metrics.startup.labels(phase=phase).set(seconds)

    def start_profile(self) -> dict[str, Any]:
        """Record the worker's steps (torch.profiler, `--profile-dir`) from its next step on."""
        return self.profiler.start()

    def stop_profile(self) -> dict[str, Any]:
        """Stop recording; the trace and op table written."""
        return self.profiler.stop()

    # -- the worker ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        last_idle_check = time.monotonic()
        while True:
            self._pull(0.0)
            decision = self.scheduler.start(time.perf_counter(), self._last_done)
            if isinstance(decision, Start):
                self._serve(decision)
            elif self._closing.is_set() and not self.scheduler.waiting and self._queue.empty():
                self.profiler.close()
                return
            else:
                until = decision.until if decision.until is not None else time.perf_counter() + 0.05
                self._pull(until - time.perf_counter())
            if self.limits.idle_timeout is not None and time.monotonic() - last_idle_check > 1.0:
                last_idle_check = time.monotonic()
                for model_id in self.registry.idle(self.limits.idle_timeout):
                    self.unload(model_id)

    def _pull(self, timeout: float) -> None:
        """Move queued requests to the scheduler, waiting up to `timeout` seconds for the first. Requests aborted
        while waiting leave here."""
        try:
            if timeout > 0:
                self.scheduler.add(self._queue.get(timeout=timeout))
            while True:
                self.scheduler.add(self._queue.get_nowait())
        except queue.Empty:
            pass
        gone = self.scheduler.cancelled()
        if gone:
            self.scheduler.take(gone)
            for job in gone:
                self.outputs.end(job)
        self.profiler.poll()  # between two steps (the batch runner pulls before each)

    def _serve(self, start: Start) -> None:
        jobs = start.jobs
        self.scheduler.take(jobs)
        for job in jobs:
            job.resumed = False
        try:
            resident = self.registry.serving(jobs[0].model_id)
        except ServiceError as exc:
            for job in jobs:
                self.outputs.end(job, error=exc)
            self.outputs.flush()
            return
        for job in jobs:  # the model may have been reloaded with another plan since they came
            job.kv_budget = resident.kv_budget
        shape = batch_shape(jobs, self.limits.scheduling(), resident.context, resident.batch_shape,
                            start.takes_joiners)
        jobs = self.scheduler.within_rows(jobs, shape.rows, time.perf_counter())
        self.metrics.batch_size.observe(len(jobs))
        self.metrics.running.set(len(jobs))
        try:
            with resident.busy:
                resident.last_used = time.monotonic()
                outcome = self.runner.run(resident, jobs, shape, start.takes_joiners)
                resident.last_used = time.monotonic()
            if outcome.left:  # stopped for requests that could not join: its unfinished ones continue after those
                self.scheduler.put_back(outcome.left, time.perf_counter())
                self.metrics.preemptions.inc()
                log.debug("batch stopped for waiting requests: %d continue", len(outcome.left))
            if outcome.failure is not None:
                self._isolate(jobs, outcome.failure)
        except Exception as exc:  # the batch failed outside its steps (its start): every request gets the reason
            self._isolate(jobs, exc)
        finally:
            self.outputs.flush()
            self.metrics.running.set(0)
            self._last_done = time.perf_counter()

    def _isolate(self, jobs: list[Job], failure: BaseException) -> None:
        """After a failed batch: the requests whose prompts ran in the failed step are suspects; one alone (or one
        failing a second time, or one that joined alone) ends with the reason, several each join alone from now on
        (so that the next failure names its request); the others continue in the next batch from the tokens they
        got. A failure with no suspect (a step of rows that had run before, or the batch's start) ends them all, as does
        the engine's end (`EngineGone`: 503 with its reason, not a 500)."""
        self.metrics.failed_steps.inc()
        suspects = {id(owner) for owner in failure.owners} if isinstance(failure, StepFailed) else set()
        cause = failure.cause if isinstance(failure, StepFailed) else failure
        log.error("a step failed (%s: %s); %d of its %d requests ran their prompts in it", type(cause).__name__,
                  cause, len(suspects), len(jobs), exc_info=cause)
        unfinished = [job for job in jobs if not job.finished and not job.cancelled.is_set()]
        if isinstance(cause, EngineGone):  # nothing can run any more (a split's process ended): 503, the reason
            for job in unfinished:
                self.outputs.end(job, error=cause)
            return
        if not suspects:
            everyone = GenerationFailed(f"generation failed: {type(cause).__name__}: {cause}")
            for job in unfinished:
                self.outputs.end(job, error=everyone)
            return
        again = []
        for job in unfinished:
            if id(job) in suspects:
                job.strikes += 1
                if len(suspects) == 1 or job.strikes > 1 or job.alone:
                    self.outputs.end(job, error=failure_for(cause))
                    continue
                job.alone = True
            again.append(job)
        self.scheduler.put_back(again, time.perf_counter())
        self.metrics.preemptions.inc()
