"""The serving engine: requests queue up, a worker thread batches those for the same model and sampling into one
`devmap.generate` call (dynamic batching: whatever arrived while the previous batch ran goes together), and
each request's tokens stream back to its own asyncio queue as the lanes produce them.

The HTTP app is a thin layer over `Engine`; Python code can use it directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import torch

from ..generation.step_cache import keep_shapes
from .errors import GenerationFailed, QueueFull, RequestTimeout, ServiceError, ShuttingDown
from .gc_pauses import watch_gc_pauses
from .metrics import ServiceMetrics
from .jobs import Completion, GenerationParams, Job
from .text_stream import eos_ids, finish_job, take_token
from .registry import ModelRegistry, ResidentModel
from .slots import continuous_possible, round_up, serve_continuous

log = logging.getLogger("devmap.serving")


@dataclass(frozen=True)
class EngineLimits:
    """Bounds of the service: batch and queue sizes, prompt and output caps, per-request timeout."""

    max_batch: int = 64
    max_queue: int = 256
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    request_timeout: float = 600.0
    idle_timeout: float | None = None  # unload models unused this long (seconds)
    lanes: int | None = None
    compile: bool = False
    batch_wait: float = 0.005  # a batch takes requests until none came for this long (seconds): clients that just
    # got their answers come back together, spread over tens of milliseconds, and without it the next batch would
    # start with the first few of them while the rest wait for its whole length
    max_batch_wait: float = 0.05  # but starts at the latest this long after its oldest request or the last batch
    length_bucket: int = 32  # prompts are left-padded to a multiple of this, new tokens rounded up to one
    graph_shapes: int = 8  # batch shapes whose captured steps stay on a model (devmap's keep_shapes)
    continuous: bool = True  # a running batch's free rows take waiting requests of the same model and sampling
    # between two decode steps (greedy and unseeded sampling); False: batches run whole, as dynamic batches
    join_wait: float = 0.01  # continuous: requests that could join wait up to this long (seconds) for more to join
    # with them, unless they fill every free row or the step's join_tokens
    join_tokens: int = 2048  # continuous: prompt tokens that join the running batch at one step, at most (beyond
    # the first request): a burst of requests joins over a few steps, each step's prefill short, so the first ones
    # answer sooner and the burst's requests end (and come back) spread out rather than all at once
    preempt_after: float = 0.25  # continuous: a request that cannot join (another model or sampling, no free row)
    # stops the running batch once it has waited this long (seconds); its unfinished requests continue later
    rejoin_after: float | None = None  # dynamic batches (continuous=False): when a request that could join the
    # running batch has waited this long (seconds) and the batch has run as long, the batch stops between two
    # steps and its unfinished requests continue in the next one together with the waiting ones (their prompt + tokens so far prefilled again:
    # recompute, as vLLM's preemption does). None: a batch runs to its end. Seeded sampling never rejoins.


class Engine:
    """Resident models and the batching worker. `start()` before use, `close()` to drain and stop."""

    def __init__(self, registry: ModelRegistry, limits: EngineLimits | None = None) -> None:
        self.registry = registry
        self.limits = limits or EngineLimits()
        self.metrics = ServiceMetrics()
        self._queue: queue.Queue[Job] = queue.Queue()
        self._waiting: list[Job] = []  # taken off the queue, not yet batched (another model or sampling)
        self._pending = 0
        self._count = threading.Lock()
        self._closing = threading.Event()
        self._worker: threading.Thread | None = None
        self._unwatch_gc: Callable[[], None] = lambda: None  # set while the worker runs
        self._last_start = self._last_done = 0.0  # perf_counter when the last batch started and finished
        self._last_size = 0  # and how many requests it held

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
        limits = self.limits
        if not prompt_ids:
            raise ServiceError("the prompt is empty", param="prompt")
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise ServiceError(f"the prompt has {len(prompt_ids)} tokens; this service takes at most "
                               f"{limits.max_prompt_tokens}", param="prompt")
        if params.max_tokens < 1 or params.max_tokens > limits.max_tokens:
            raise ServiceError(f"max_tokens must be between 1 and {limits.max_tokens}, got {params.max_tokens}",
                               param="max_tokens")
        if resident.context and len(prompt_ids) + params.max_tokens > resident.context:
            raise ServiceError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                               f"more than the model's context of {resident.context} tokens", param="max_tokens")

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
        job = Job(model_id, list(prompt_ids), params, asyncio.get_running_loop())
        self._queue.put(job)
        return job

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """The request's text as it is generated; ends when the request finishes (see `job.finish_reason`)."""
        deadline = job.arrived + self.limits.request_timeout
        try:
            while True:
                left = deadline - time.perf_counter()
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=max(left, 0.0))
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"the request ran past the service's timeout of "
                                         f"{self.limits.request_timeout:g} s") from None
                if event[0] == "text":
                    yield event[1]
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
            batch = self._next_batch()
            if batch:
                self._serve(batch)
            elif self._closing.is_set() and not self._waiting and self._queue.empty():
                return
            if self.limits.idle_timeout is not None and time.monotonic() - last_idle_check > 1.0:
                last_idle_check = time.monotonic()
                for model_id in self.registry.idle(self.limits.idle_timeout):
                    self.registry.unload(model_id)
                self.metrics.models.set(len(self.registry.all()))

    def _next_batch(self) -> list[Job]:
        """The oldest waiting request and every other waiting one of the same model and sampling (up to max_batch)."""
        if not self._waiting:
            try:
                self._waiting.append(self._queue.get(timeout=0.05))
            except queue.Empty:
                return []
        # A batch that just finished sends its clients their answers; in a busy service they come back within
        # tens of milliseconds. Until as many requests as it held have arrived since it started, the next batch
        # waits for them (at most max_batch_wait after the later of its oldest request and that finish); then
        # it takes requests until none has come for batch_wait.
        latest = max(self._waiting[0].arrived, self._last_done) + self.limits.max_batch_wait
        if any(j.resumed for j in self._waiting):  # a batch stopped for the waiting ones: go on at once
            latest = 0.0
        while len(self._waiting) < self.limits.max_batch:
            left = latest - time.perf_counter()
            back = sum(j.arrived > self._last_start for j in self._waiting)
            # continuous batches take late requests as they come: they never wait for the whole last batch
            enough = back >= self._last_size or self.limits.continuous
            wait = min(self.limits.batch_wait, left) if enough else left
            try:
                self._waiting.append(self._queue.get(timeout=max(wait, 0.0)))
            except queue.Empty:
                break
        first = self._waiting[0]
        key = (first.model_id, first.params.batch_key())
        batch = [j for j in self._waiting if (j.model_id, j.params.batch_key()) == key][: self.limits.max_batch]
        self.take(batch)
        return [j for j in batch if not j.cancelled.is_set()]

    def drain_queue(self) -> None:
        """Move every queued request to the waiting list (worker thread only)."""
        while True:
            try:
                self._waiting.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def await_request(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a queued request and move it to the waiting list (worker thread only);
        False if none came."""
        try:
            self._waiting.append(self._queue.get(timeout=max(timeout, 0.0)))
        except queue.Empty:
            return False
        return True

    @property
    def waiting(self) -> list[Job]:
        """Requests taken off the queue and not yet in a batch, oldest first (worker thread only)."""
        return self._waiting

    def take(self, batch: list[Job]) -> None:
        """These waiting requests go into a batch now (worker thread only)."""
        chosen = {id(j) for j in batch}
        self._waiting = [j for j in self._waiting if id(j) not in chosen]
        fresh = sum(not j.resumed for j in batch)
        with self._count:
            self._pending -= fresh
        self.metrics.queue_depth.dec(fresh)
        for job in batch:
            job.resumed = False

    def _rejoin_check(self, jobs: list[Job]) -> Any:
        """For a batch of `jobs`: a function of the batch's start time that says whether to stop it now, so that
        a request of the same model and sampling which waited `rejoin_after` joins (None: this batch never stops)."""
        wait = self.limits.rejoin_after
        key = (jobs[0].model_id, jobs[0].params.batch_key())
        if wait is None or (jobs[0].params.temperature != 0 and jobs[0].params.seed is not None):
            return None

        def check(started: float) -> bool:
            now = time.perf_counter()
            if now - started < wait:
                return False
            self.drain_queue()
            return any(now - j.arrived >= wait and (j.model_id, j.params.batch_key()) == key
                       and not j.cancelled.is_set() for j in self._waiting)

        return check

    def _serve(self, jobs: list[Job]) -> None:
        try:
            resident = self.registry.get(jobs[0].model_id)
        except ServiceError as exc:
            for job in jobs:
                job.emit("error", exc)
            return
        self.metrics.batch_size.observe(len(jobs))
        self._last_start, self._last_size = time.perf_counter(), len(jobs)
        self.metrics.running.set(len(jobs))
        try:
            with resident.busy:
                resident.last_used = time.monotonic()
                keep_shapes(resident.model, self.limits.graph_shapes)
                if self.limits.continuous and continuous_possible(jobs[0].params):
                    going_on = serve_continuous(self, resident, jobs)  # joiners are appended to `jobs`
                    stopped = bool(going_on)
                else:
                    stopped = _generate(resident, jobs, self.limits, self.metrics, self._rejoin_check(jobs))
                    going_on = [j for j in jobs if not j.finished and not j.cancelled.is_set()] if stopped else []
                resident.last_used = time.monotonic()
            if stopped:  # its unfinished requests continue in a later batch, prefilled again
                now = time.perf_counter()
                for job in going_on:
                    job.resumed, job.waiting_since = True, now
                # a dynamic batch stopped for requests that join them: first; a continuous one stopped for
                # requests that could not join (another model, no row): after those
                self._waiting = self._waiting + going_on if self.limits.continuous else going_on + self._waiting
                self.metrics.rejoins.inc()
                log.debug("batch stopped for waiting requests: %d continue", len(going_on))
        except Exception as exc:  # the batch failed: every request in it gets the reason, the service goes on
            failure = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            for job in jobs:
                if not job.finished:
                    job.finished = True
                    job.emit("error", failure)
        finally:
            self.metrics.running.set(0)
            self._last_done = time.perf_counter()


def _generate(resident: ResidentModel, jobs: list[Job], limits: EngineLimits, metrics: ServiceMetrics,
              stop_for_waiting: Any = None) -> bool:
    """One devmap.generate call for the batch; tokens go to each job as the lanes produce them. A job that
    continues a stopped batch starts from its prompt and the tokens it has. True when `stop_for_waiting(start)`
    stopped the batch before its end (its unfinished jobs are left unfinished)."""
    from ..generation.api import generate

    tokenizer = resident.tokenizer
    eos = eos_ids(resident)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    # batch shapes in buckets (rows: powers of two; lengths: multiples of length_bucket), so that a service
    # sees few shapes and replays their captured steps instead of capturing (or compiling) each new one
    rows = min(1 << (len(jobs) - 1).bit_length(), max(limits.max_batch, len(jobs)))
    prompts = [j.prompt_ids + j.generated for j in jobs]
    longest = max(len(p) for p in prompts)
    most = max(j.params.max_tokens - len(j.generated) for j in jobs)
    length, new = round_up(longest, limits.length_bucket), round_up(most, limits.length_bucket)
    if resident.context:  # the bucket never costs a request its tokens (check() made longest + most fit)
        if length + most > resident.context:
            length = longest
        new = min(new, resident.context - length)
    ids = torch.full((rows, length), pad, dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.long)
    for row in range(rows):  # left padding: every row continues from its last column; extra rows repeat the first
        prompt = prompts[row] if row < len(jobs) else prompts[0]
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        mask[row, length - len(prompt):] = 1
    params = jobs[0].params

    started, first, stopped = time.perf_counter(), [], []

    def on_tokens(lane_rows: slice, step: int, tokens: torch.Tensor) -> bool:
        if not first:
            first.append(time.perf_counter())
        if not stopped and stop_for_waiting is not None and stop_for_waiting(started):
            stopped.append(step)  # this step's tokens still count; the next ones are not asked for
        for offset, row in enumerate(range(lane_rows.start, min(lane_rows.stop, len(jobs)))):
            job = jobs[row]
            if not job.finished and not job.cancelled.is_set():
                take_token(job, int(tokens[offset]), resident, eos, metrics)
        return not stopped and any(not j.finished and not j.cancelled.is_set() for j in jobs)

    generate(resident.model, ids, mask, max_new_tokens=new, lanes=limits.lanes,
             do_sample=params.temperature != 0, temperature=params.temperature or 1.0, top_k=params.top_k,
             top_p=params.top_p, seed=params.seed or 0, eos_token_id=eos, pad_token_id=pad,
             compile=limits.compile, on_tokens=on_tokens)
    for job in jobs if not stopped else ():  # ran into the context's end
        if not job.finished:
            finish_job(job, "length", resident, metrics)
    if log.isEnabledFor(logging.DEBUG):
        done = time.perf_counter()
        log.debug("batch of %d (rows %d, prompt %d, new %d): oldest waited %.0f ms, first tokens %.0f ms, "
                  "done %.0f ms", len(jobs), rows, length, new, 1000 * (started - min(j.arrived for j in jobs)),
                  1000 * ((first[0] if first else done) - started), 1000 * (done - started))
    return bool(stopped)
