"""The serving engine: requests queue up; one worker thread owns the models and time, and runs continuous batches
as vLLM's engine core does: each turn of its loop asks the scheduler (`scheduler.py`, pure policy) who runs next,
issues one step of the batch (`devmap.generation.continuous`), and hands the tokens that came back to their
requests (`text_stream.py`), whose text streams to each request's asyncio queue.

The HTTP app is a thin layer over `Engine`; Python code can use it directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from ..generation.continuous import ContinuousBatch, SlotRequest, continuous_batch
from ..generation.sampling import Sampling
from ..generation.step_cache import keep_shapes
from .errors import GenerationFailed, QueueFull, RequestTimeout, ServiceError, ShuttingDown
from .gc_pauses import watch_gc_pauses
from .metrics import ServiceMetrics
from .jobs import Completion, GenerationParams, Job, Outbox
from .text_stream import eos_ids, take_token
from .registry import ModelRegistry, ResidentModel
from .batch_trace import BatchTrace, PhaseClock
from .limits import EngineLimits
from .scheduler import BatchShape, RunningBatch, Scheduler, Start, batch_shape, grown, key_of

log = logging.getLogger("devmap.serving")


class Engine:
    """Resident models and the batching worker. `start()` before use, `close()` to drain and stop."""

    def __init__(self, registry: ModelRegistry, limits: EngineLimits | None = None) -> None:
        self.registry = registry
        self.limits = limits or EngineLimits()
        if registry is not None:
            registry.limits = self.limits  # its loads make room for the batches these limits allow
        self.metrics = ServiceMetrics()
        self._queue: queue.Queue[Job] = queue.Queue()
        self.scheduler = Scheduler(self.limits.scheduling())  # the worker's: requests taken off the queue
        self._pending = 0  # requests submitted and not yet in a batch (the queue's bound)
        self._count = threading.Lock()
        self._closing = threading.Event()
        self._worker: threading.Thread | None = None
        self._unwatch_gc: Callable[[], None] = lambda: None  # set while the worker runs
        self._last_done = 0.0  # perf_counter when the last batch ended
        self._outbox = Outbox()  # the worker's events for the requests' streams, flushed once per step

    def start(self) -> None:
        if self._worker is None:
            self._unwatch_gc = watch_gc_pauses(observe=self.metrics.gc_pauses.observe)
            self._worker = threading.Thread(target=self._run, name="devmap-engine", daemon=True)
            self._worker.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued and running ones, stop the worker."""
        self._closing.set()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker = None
            self._unwatch_gc()

    # -- requests -----------------------------------------------------------------------------------------------

    def check(self, resident: ResidentModel, prompt_ids: list[int], params: GenerationParams) -> None:
        """Refuse what the limits or the model's context do not allow (a 400 naming the field)."""
        self.limits.check_request(len(prompt_ids), params.max_new_tokens, resident.context)

    def submit(self, model_id: str, prompt_ids: list[int], params: GenerationParams) -> Job:
        """Queue a request (from a coroutine: its events arrive on the running loop)."""
        if self._closing.is_set():
            raise ShuttingDown("the service is shutting down")
        resident = self.registry.get(model_id)
        self.check(resident, prompt_ids, params)
        with self._count:
            if self._pending >= self.limits.max_queue:
                raise QueueFull(f"{self._pending} requests are waiting, the most this service queues; retry later")
            self._pending += 1
        self.metrics.queue_depth.inc()
        self.metrics.prompt_tokens.labels(model=model_id).inc(len(prompt_ids))
        job = Job(model_id, list(prompt_ids), params, asyncio.get_running_loop(), outbox=self._outbox,
                  kv_budget=resident.kv_budget)
        self._queue.put(job)
        return job

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """The request's text as it is generated; ends when the request finishes (see `job.finish_reason`)."""
        deadline = job.arrived + self.limits.request_timeout
        held: tuple | None = None  # an event read while gathering text, handled next
        try:
            while True:
                if held is not None:
                    event, held = held, None
                else:
                    left = deadline - time.perf_counter()
                    try:
                        event = await asyncio.wait_for(job.events.get(), timeout=max(left, 0.0))
                    except asyncio.TimeoutError:
                        raise RequestTimeout(f"the request ran past the service's timeout of "
                                             f"{self.limits.request_timeout:g} s") from None
                if event[0] == "text":
                    text = event[1]
                    while not job.events.empty():  # what came while the client was slower goes as one chunk
                        more = job.events.get_nowait()
                        if more[0] != "text":
                            held = more
                            break
                        text += more[1]
                    yield text
                elif event[0] == "done":
                    job.finish_reason = event[1]
                    return
                else:
                    raise event[1]
        finally:
            job.cancelled.set()  # a client that went away (or timed out) frees its row of the batch

    async def complete(self, model_id: str, prompt_ids: list[int], params: GenerationParams) -> Completion:
        job = self.submit(model_id, prompt_ids, params)
        text = "".join([piece async for piece in self.stream(job)])
        return Completion(text, job.finish_reason or "stop", len(prompt_ids), len(job.generated))

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
                    self.registry.unload(model_id)
                self.metrics.models.set(len(self.registry.all()))

    def _pull(self, timeout: float) -> bool:
        """Move queued requests to the scheduler, waiting up to `timeout` seconds for the first; False if none came.
        Requests whose clients went away while waiting leave here."""
        got = False
        try:
            if timeout > 0:
                self.scheduler.add(self._queue.get(timeout=timeout))
                got = True
            while True:
                self.scheduler.add(self._queue.get_nowait())
                got = True
        except queue.Empty:
            pass
        gone = self.scheduler.cancelled()
        if gone:
            self._taken(gone)
        return got

    def _taken(self, jobs: list[Job]) -> None:
        """These waiting requests leave the waiting list (into a batch, or gone): out of the queue's count."""
        self.scheduler.take(jobs)
        fresh = sum(not j.resumed for j in jobs)
        with self._count:
            self._pending -= fresh
        self.metrics.queue_depth.dec(fresh)
        for job in jobs:
            job.resumed = False

    def _serve(self, start: Start) -> None:
        jobs = start.jobs
        self._taken(jobs)
        try:
            resident = self.registry.get(jobs[0].model_id)
        except ServiceError as exc:
            for job in jobs:
                job.emit("error", exc)
            self._outbox.flush()
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
            failure = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            for job in jobs:
                if not job.finished:
                    job.finished = True
                    job.emit("error", failure)
        finally:
            self._outbox.flush()
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
        eos = eos_ids(resident)
        trace = BatchTrace(time.perf_counter(), shape.rows)
        stopped = False
        with continuous_batch(resident.model, rows=shape.rows, first_slot=shape.first_slot,
                              cache_len=shape.cache_len, lanes=limits.lanes, sampling=sampling,
                              compile=resident.compiled, kv_room=resident.kv_room) as batch:
            joining = list(jobs)
            clock = PhaseClock(self.metrics)
            while batch.step([_slot_request(job) for job in joining]):
                clock.mark("launch")
                self.metrics.decode_steps.inc()
                tokens = batch.collect()
                clock.mark("collect")
                self._hand_back(batch, tokens, resident, eos, trace)
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
                    self._hand_back(batch, batch.collect(everything=True), resident, eos, trace)
                    clock.mark("hand_back")
                    self._pull(admission.wait_until - time.perf_counter())
                    clock.mark("idle")
                if admission.stop:
                    stopped = True
                    break
                joining = admission.joining
                if joining:
                    self._taken(joining)
                    now = time.perf_counter()
                    for job in joining:
                        trace.admitted[id(job)] = (now, free)
                    jobs.extend(joining)
                    self.metrics.joined.inc(len(joining))
                self.metrics.running.set(shape.rows - free + len(joining))
                clock.mark("schedule")
            self._hand_back(batch, batch.collect(everything=True), resident, eos, trace)
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

    def _hand_back(self, batch: ContinuousBatch, tokens: list[tuple[Any, int]], resident: ResidentModel,
                   eos: list[int], trace: BatchTrace) -> None:
        """Each token to its request (text out, the stop rule applied); the rows of requests that ended or whose
        clients went away are released for joiners."""
        for job, token in tokens:
            if job.finished or job.cancelled.is_set():
                batch.release(job)
                continue
            if not job.generated:
                trace.first_token(job)
            take_token(job, token, resident, eos, self.metrics)
            if job.finished:
                batch.release(job)
        self._outbox.flush()


def _slot_request(job: Job) -> SlotRequest:
    """The job as a row's request: its prompt and the tokens it already has (a stopped batch's), its budget left."""
    return SlotRequest(job.prompt_ids + job.generated, job.budget_left, job)
