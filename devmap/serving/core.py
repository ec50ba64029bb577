"""The engine core: the resident models and the loop that runs continuous batches on them, at the level of token
ids. Built as vLLM's engine core is: each turn of its loop asks the scheduler (`scheduler.py`, pure policy) who runs
next, issues one step of the batch (`devmap.generation.continuous`), and hands the tokens that came back to
`deliver` as one list of `TokenOutput` per step. The core applies the token stop rule (an end-of-sequence token, or
the request's token budget); text, stop strings and HTTP live on the API side (`engine.py`), which may be another
process (`core_client.py`), so that no request's Python work holds this loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..generation.continuous import ContinuousBatch, SlotRequest, continuous_batch
from ..generation.sampling import Sampling
from ..generation.step_cache import keep_shapes
from .batch_trace import BatchTrace, PhaseClock
from .errors import GenerationFailed, ServiceError
from .gc_pauses import watch_gc_pauses
from .jobs import Job, TokenOutput
from .limits import EngineLimits
from .metrics import EngineMetrics
from .registry import ModelRegistry, ResidentModel
from .scheduler import BatchShape, RunningBatch, Scheduler, Start, batch_shape, grown, key_of

log = logging.getLogger("devmap.serving")

Deliver = Callable[[list[TokenOutput]], None]
"""Takes each step's outputs (called from the core's thread)."""
CONTROL = ("models", "describe", "load", "unload", "render_metrics")  # the core's methods the API may call


class EngineCore:
    """Requests in (`add`, `abort`), tokens out (`deliver`), one worker thread between. `start()` before use,
    `close()` to finish the queued and running requests and stop."""

    def __init__(self, registry: ModelRegistry, limits: EngineLimits, deliver: Deliver,
                 unloaded: Callable[[str], None] = lambda model_id: None) -> None:
        self.registry, self.limits = registry, limits
        self.deliver, self.unloaded = deliver, unloaded
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(limits.scheduling())  # the worker's: requests taken off the queue
        self._queue: queue.Queue[Job] = queue.Queue()
        self._jobs: dict[int, Job] = {}  # every request not yet ended, by id (abort finds them here)
        self._jobs_lock = threading.Lock()
        self._closing = threading.Event()
        self._worker: threading.Thread | None = None
        self._unwatch_gc: Callable[[], None] = lambda: None  # set while the worker runs
        self._last_done = 0.0  # perf_counter when the last batch ended
        self._outputs: dict[int, TokenOutput] = {}  # this step's, by request id (the worker's)

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

    def add(self, job: Job) -> None:
        """Queue a request (any thread). Its model is looked up when it starts: a model unloaded meanwhile ends it
        with a 404 in its output."""
        with self._jobs_lock:
            self._jobs[job.id] = job
        self._queue.put(job)

    def abort(self, request_id: int) -> None:
        """The request's client went away or a stop string ended its text (any thread): its row is freed at the
        next step; nothing more is delivered for it."""
        with self._jobs_lock:
            job = self._jobs.get(request_id)
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
        resident = self.registry.load(path, model_id, device_map, max_memory, dtype)
        self.metrics.models.set(len(self.registry.all()))
        return {**resident.describe(), "plan": resident.model.devmap_plan.to_dict(), "load_report": resident.report}

    def unload(self, model_id: str) -> None:
        self.registry.unload(model_id)
        self.metrics.models.set(len(self.registry.all()))
        self.unloaded(model_id)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.registry.planned())

    # -- the worker ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        last_idle_check = time.monotonic()
        while True:
            self._pull(0.0)
            decision = self.scheduler.start(time.perf_counter(), self._last_done)
            if isinstance(decision, Start):
                self._serve(decision)
            elif self._closing.is_set() and not self.scheduler.waiting and self._queue.empty():
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
                self._end(job)

    def _end(self, job: Job, reason: str | None = None, error: ServiceError | None = None) -> None:
        """The request ended: its last output says why (an aborted one gets none)."""
        job.finished = True
        with self._jobs_lock:
            self._jobs.pop(job.id, None)
        if not job.cancelled.is_set() and (reason or error):
            out = self._output(job)
            out.finish_reason, out.error = reason, error

    def _output(self, job: Job) -> TokenOutput:
        out = self._outputs.get(job.id)
        if out is None:
            out = self._outputs[job.id] = TokenOutput(job.id)
        return out

    def _flush(self) -> None:
        """This step's outputs to `deliver`, as one list."""
        if self._outputs:
            outputs, self._outputs = list(self._outputs.values()), {}
            self.deliver(outputs)

    def _serve(self, start: Start) -> None:
        jobs = start.jobs
        self.scheduler.take(jobs)
        for job in jobs:
            job.resumed = False
        try:
            resident = self.registry.get(jobs[0].model_id)
        except ServiceError as exc:
            for job in jobs:
                self._end(job, error=exc)
            self._flush()
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
                keep_shapes(resident.model, self.limits.graph_shapes)
                left = self._run_batch(resident, jobs, shape, start.takes_joiners)
                resident.last_used = time.monotonic()
            if left:  # stopped for requests that could not join: its unfinished ones continue after those
                self.scheduler.put_back(left, time.perf_counter())
                self.metrics.preemptions.inc()
                log.debug("batch stopped for waiting requests: %d continue", len(left))
        except Exception as exc:  # the batch failed: every request in it gets the reason, the service goes on
            log.exception("a batch failed")
            failure = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            for job in jobs:
                if not job.finished:
                    self._end(job, error=failure)
        finally:
            self._flush()
            self.metrics.running.set(0)
            self._last_done = time.perf_counter()

    def _run_batch(self, resident: ResidentModel, jobs: list[Job], shape: BatchShape, joiners: bool) -> list[Job]:
        """One continuous batch of `shape` on the model, starting with `jobs` (requests that join are appended to
        it), step by step until it drains or the scheduler stops it; returns the unfinished requests when it was
        stopped."""
        limits = self.limits
        if joiners:  # the model's batches settle on one shape (a seeded batch's own shape is not kept)
            resident.batch_shape = grown(resident.batch_shape, shape)
        params = jobs[0].params
        sampling = Sampling(params.temperature != 0, params.temperature or 1.0, params.top_k, params.top_p,
                            params.seed or 0)
        running = RunningBatch(key_of(jobs[0]), shape, joiners)
        eos = frozenset(resident.eos_ids)
        trace = BatchTrace(time.perf_counter(), shape.rows)
        stopped = False
        with continuous_batch(resident.model, rows=shape.rows, first_slot=shape.first_slot,
                              cache_len=shape.cache_len, lanes=limits.lanes, sampling=sampling,
                              compile=resident.compiled, kv_room=resident.kv_room,
                              riding=limits.riding) as batch:
            running.riding = batch.mixing
            joining = list(jobs)
            clock = PhaseClock(self.metrics)
            while batch.step([_slot_request(job) for job in joining]):
                clock.mark("launch")
                self.metrics.decode_steps.inc()
                tokens = batch.collect()
                clock.mark("collect")
                self._hand_back(batch, tokens, eos, trace)
                clock.mark("hand_back")
                joining = []
                while True:
                    self._pull(0.0)
                    free = len(batch.free_rows())
                    admission = self.scheduler.admit(running, free, time.perf_counter())
                    if admission.wait_until is None:
                        break
                    # every row is free: their clients get their last tokens, and are likely on their way back;
                    # waiting a little for them keeps the batch and its captured steps instead of starting anew
                    self._hand_back(batch, batch.collect(everything=True), eos, trace)
                    clock.mark("hand_back")
                    self._pull(admission.wait_until - time.perf_counter())
                    clock.mark("idle")
                if admission.stop:
                    stopped = True
                    break
                joining = admission.joining
                if joining:
                    self.scheduler.take(joining)
                    now = time.perf_counter()
                    for job in joining:
                        job.resumed = False
                        trace.admitted[id(job)] = (now, free)
                    jobs.extend(joining)
                    self.metrics.joined.inc(len(joining))
                self.metrics.running.set(shape.rows - free + len(joining))
                clock.mark("schedule")
            self._hand_back(batch, batch.collect(everything=True), eos, trace)
            unfinished = {id(owner) for owner in batch.unfinished()}
        if log.isEnabledFor(logging.DEBUG):
            log.debug("continuous batch (rows %d, first slot %d, cache %d): %d requests, %d joined (issued in %.0f "
                      "ms), slowest first token %.0f ms, %s after %d steps, %.0f ms", shape.rows, shape.first_slot,
                      shape.cache_len, len(jobs), batch.stats["joined"], 1000 * batch.stats["join_seconds"],
                      1000 * trace.slowest, "stopped" if stopped else "drained", batch.stats["steps"],
                      1000 * (time.perf_counter() - trace.started))
        if not stopped:
            return []
        return [job for job in jobs if id(job) in unfinished and not job.finished and not job.cancelled.is_set()]

    def _hand_back(self, batch: ContinuousBatch, tokens: list[tuple[Any, int]], eos: frozenset[int],
                   trace: BatchTrace) -> None:
        """Each token to its request's output (the token stop rule applied: an end-of-sequence token or its budget
        ends it); the rows of requests that ended or were aborted are released for joiners; the outputs go out."""
        for job, token in tokens:
            if job.finished or job.cancelled.is_set():
                if not job.finished:
                    self._end(job)
                batch.release(job)
                continue
            if not job.generated:
                trace.first_token(job)
            if token in eos:
                self._end(job, "stop")
            else:
                job.generated.append(token)
                self._output(job).tokens.append(token)
                if job.budget_left <= 0:
                    self._end(job, "length")
            if job.finished:
                batch.release(job)
        self._flush()


def _slot_request(job: Job) -> SlotRequest:
    """The job as a row's request: its prompt and the tokens it already has (a stopped batch's), its budget left."""
    return SlotRequest(job.prompt_ids + job.generated, job.budget_left, job)
