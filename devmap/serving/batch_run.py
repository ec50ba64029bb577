"""One continuous batch on a resident model, step by step: requests join its free rows as the scheduler admits them,
tokens go back to their requests after each step, and the batch ends when it drains, when the scheduler stops it for
requests that cannot join, when its model's unload has waited long enough, or when a step fails.

A failing step never takes the batch's other requests with it: the batch is given up, and its unfinished requests
continue in the next batch from their prompts and the tokens they got (greedy tokens are the ones they would have had:
the same path as a batch stopped for others). Only the requests whose prompts ran in that step can be at fault
(`StepFailed.owners`): one alone is ended with the reason; several each join alone from then on, so that the next
failure names its request. A step that fails with no prompt in it (nothing new in it) ends every request of the
batch with the reason.

How a batch runs on a model is `Batches`: the model's continuous batches and prompt scoring (`ModelBatches`), or a
stand-in that tests drive the same loop with.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

from ..errors import DevmapError
from ..generation.continuous import ContinuousBatch, SlotRequest, continuous_batch
from ..generation.row_types import StepFailed
from ..generation.sampling import Sampling
from ..generation.row_types import Score
from ..generation.scores import prompt_scores
from ..generation.step_cache import keep_shapes
from .batch_trace import BatchTrace, PhaseClock
from .errors import GenerationFailed, ModelUnloading, ServiceError
from .jobs import Job
from .limits import EngineLimits
from .metrics import EngineMetrics
from .outputs import StepOutputs
from .resident import ResidentModel
from .scheduler import Admission, BatchShape, RunningBatch, Scheduler, grown, key_of
from .stall_sampler import StallSampler
from .warm_marks import ServedShapes, remember

log = logging.getLogger("devmap.serving")


class Batches(Protocol):
    """How the core runs work on a resident model."""

    def open(self, resident: ResidentModel, shape: BatchShape, sampling: Sampling,
             scores: int | None) -> ContextManager[ContinuousBatch]:
        """A continuous batch of `shape` on the model (see `devmap.generation.continuous_batch`)."""

    def prompt_scores(self, resident: ResidentModel, ids: list[int], top: int) -> list[Score | None]:
        """The prompt's tokens' scores (`devmap.generation.scores.prompt_scores`)."""


class ModelBatches:
    """The model's own continuous batches in its lanes, with the engine's limits (riding, kept shapes)."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits

    def open(self, resident: ResidentModel, shape: BatchShape, sampling: Sampling,
             scores: int | None) -> ContextManager[ContinuousBatch]:
        keep_shapes(resident.model, self.limits.graph_shapes)
        return continuous_batch(resident.model, rows=shape.rows, first_slot=shape.first_slot,
                                cache_len=shape.cache_len, lanes=resident.lanes, sampling=sampling,
                                compile=resident.compiled, kv_room=resident.kv_room, riding=self.limits.riding,
                                scores=scores)

    def prompt_scores(self, resident: ResidentModel, ids: list[int], top: int) -> list[Score | None]:
        return prompt_scores(resident.model, ids, top)


@dataclass
class Outcome:
    """How a batch ended: `left`, the unfinished requests of a batch the scheduler stopped (they continue later);
    `failure`, the `StepFailed` of a failed step (a batch that cannot start raises instead)."""

    left: list[Job] = field(default_factory=list)
    failure: StepFailed | None = None


def failure_for(cause: BaseException) -> ServiceError:
    """What a request at fault for a failed step is told: its own error where devmap refused its input (400), else
    500 with the reason."""
    if isinstance(cause, ServiceError):
        return cause
    if isinstance(cause, DevmapError):
        return ServiceError(f"the model cannot run this request: {cause}")
    return GenerationFailed(f"generation failed for this request: {type(cause).__name__}: {cause}")


class BatchRunner:
    """Runs one continuous batch at a time for the core: the scheduler says who joins or stops it, `outputs` takes
    the tokens, `pull` moves queued requests to the scheduler between steps."""

    def __init__(self, scheduler: Scheduler, limits: EngineLimits, metrics: EngineMetrics, outputs: StepOutputs,
                 pull: Any, batches: Batches) -> None:
        self.scheduler, self.limits, self.metrics = scheduler, limits, metrics
        self.outputs, self.pull, self.batches = outputs, pull, batches
        self.sampler: StallSampler | None = None  # where the loop thread sits, while the debug log is on

    def _sampler(self) -> StallSampler | None:
        """The loop thread's stall sampler (started at its first batch with the debug log on), else None."""
        if self.sampler is None and log.isEnabledFor(logging.DEBUG):
            self.sampler = StallSampler(threading.get_ident())
        return self.sampler

    def close(self) -> None:
        """Stop what runs beside the loop thread (its stall sampler)."""
        if self.sampler is not None:
            self.sampler.close()

    def run(self, resident: ResidentModel, jobs: list[Job], shape: BatchShape, joiners: bool) -> Outcome:
        """One continuous batch of `shape` on the model, starting with `jobs` (requests that join are appended to
        it), step by step until it drains, the scheduler stops it, its model's unload ends it, or a step fails."""
        if joiners:  # the model's batches settle on one shape (a seeded batch's own shape is not kept)
            resident.batch_shape = grown(resident.batch_shape, shape)
        params = jobs[0].params
        sampling = Sampling(params.temperature != 0, params.temperature or 1.0, params.top_k, params.top_p,
                            params.seed or 0)
        running = RunningBatch(key_of(jobs[0]), shape, joiners)
        eos = frozenset(resident.eos_ids)
        trace = BatchTrace(time.perf_counter(), shape.rows, self._sampler())
        outcome = Outcome()
        stopped = False
        self._score_prompts(resident, jobs)
        compiled = resident.compiled  # a model compiling beside its serving: its batch moves to compiled steps
        served = None  # the shapes this batch served at, where its steps ran compiled throughout
        with self.batches.open(resident, shape, sampling, params.logprobs) as batch:  # a start that fails raises
            running.riding = batch.mixing
            joining = [job for job in jobs if not job.finished]
            clock = PhaseClock(self.metrics)
            while True:
                began = time.perf_counter()
                try:
                    if not batch.step([_slot_request(job) for job in joining]):
                        break
                except StepFailed as failed:
                    outcome.failure = failed
                    break
                launched = time.perf_counter()
                clock.mark("launch")
                self.metrics.decode_steps.inc()
                tokens = batch.collect(scored=True)
                clock.mark("collect")
                trace.step(began, launched, len(joining), compiled)
                self._busy(batch)
                self._hand_back(batch, tokens, eos, trace)
                clock.mark("hand_back")
                joining = []
                if self._unloaded(resident, jobs):
                    break
                if resident.compiled and not compiled:  # its compiled steps are ready: the batch runs them from now on
                    batch.recompile()
                    compiled = True
                    log.info("%s: its running batch moved to compiled steps", resident.id)
                admission, free = self._admission(batch, running, eos, trace, clock)
                if admission.stop:
                    stopped = True
                    break
                joining = admission.joining
                if joining:
                    self.scheduler.take(joining)
                    self._score_prompts(resident, joining)
                    now = time.perf_counter()
                    for job in joining:
                        job.resumed = False
                        trace.admitted[id(job)] = (now, free)
                    jobs.extend(joining)
                    joining = [job for job in joining if not job.finished]
                    self.metrics.joined.inc(len(joining))
                self.metrics.running.set(shape.rows - free + len(joining))
                clock.mark("schedule")
            if outcome.failure is None:
                self._hand_back(batch, batch.collect(everything=True, scored=True), eos, trace)
            else:
                with contextlib.suppress(Exception):  # what the steps before the failed one made, where it can
                    self._hand_back(batch, batch.collect(everything=True, scored=True), eos, trace)
            unfinished = {id(owner) for owner in batch.unfinished()}
            if joiners and compiled and outcome.failure is None and resident.warm_key is not None:
                served = ServedShapes(shape, tuple(batch.join_shapes()))
        if served is not None and served != resident.kept_shapes:  # for the model's next start (`warm_marks`)
            resident.kept_shapes = served  # first: whoever reads the record finds the model's own agreeing
            remember(resident.warm_key, served)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("continuous batch (rows %d, first slot %d, cache %d): %d requests, %d joined (issued in %.0f "
                      "ms), slowest first token %.0f ms, %s after %d steps, %.0f ms", shape.rows, shape.first_slot,
                      shape.cache_len, len(jobs), batch.stats["joined"], 1000 * batch.stats["join_seconds"],
                      1000 * trace.slowest, "failed" if outcome.failure else "stopped" if stopped else "drained",
                      batch.stats["steps"], 1000 * (time.perf_counter() - trace.started))
        if stopped:
            outcome.left = [job for job in jobs if id(job) in unfinished and not job.finished
                            and not job.cancelled.is_set()]
        return outcome

    def _admission(self, batch: ContinuousBatch, running: RunningBatch, eos: frozenset[int], trace: BatchTrace,
                   clock: PhaseClock) -> tuple[Admission, int]:
        """The scheduler's word before the next step, and the batch's free rows it was given; while every row is
        free, the batch waits (a little) for clients coming back instead of ending."""
        while True:
            self.pull(0.0)
            free = batch.free_count()
            admission = self.scheduler.admit(running, free, time.perf_counter())
            if admission.wait_until is None:
                return admission, free
            # every row is free: their clients get their last tokens, and are likely on their way back; waiting a
            # little for them keeps the batch and its captured steps instead of starting anew
            self._hand_back(batch, batch.collect(everything=True, scored=True), eos, trace)
            clock.mark("hand_back")
            self.pull(admission.wait_until - time.perf_counter())
            clock.mark("idle")

    def _busy(self, batch: ContinuousBatch) -> None:
        """How busy each stage's GPU was in the batch's sampled windows of steps, into /metrics."""
        for stage, device, busy, span in batch.busy():
            labels = {"stage": str(stage), "device": str(device)}
            self.metrics.stage_busy.labels(**labels).set(busy / span if span else 0.0)
            self.metrics.stage_busy_seconds.labels(**labels).inc(busy)
            self.metrics.stage_sampled_seconds.labels(**labels).inc(span)

    def _unloaded(self, resident: ResidentModel, jobs: list[Job]) -> bool:
        """Whether the model's unload has waited its drain bound: then every request of the batch ends with the
        reason, and the batch with them."""
        if not resident.drained():
            return False
        gone = ModelUnloading(f"model {resident.id!r} was unloaded before this request finished (it had "
                              f"{self.limits.unload_drain:g} s to finish)", param="model")
        for job in jobs:
            if not job.finished:
                self.outputs.end(job, error=gone)
        self.outputs.flush()
        return True

    def _score_prompts(self, resident: ResidentModel, jobs: list[Job]) -> None:
        """The prompts' scores of requests that asked for them (echo with logprobs), once each: a prompt that cannot
        be scored ends its request alone."""
        for job in jobs:
            if job.params.echo and job.params.logprobs is not None and not job.prompt_scored:
                job.prompt_scored = True
                try:
                    scores = self.batches.prompt_scores(resident, job.prompt_ids, job.params.logprobs)
                except Exception as exc:
                    log.exception("scoring a prompt failed")
                    self.outputs.end(job, error=failure_for(exc))
                    continue
                self.outputs.output(job).prompt_scores = scores
        self.outputs.flush()

    def _hand_back(self, batch: ContinuousBatch, tokens: list[tuple[Any, int, Any]], eos: frozenset[int],
                   trace: BatchTrace) -> None:
        """Each token to its request's output (the token stop rule applied: an end-of-sequence token or its budget
        ends it); the rows of requests that ended or were aborted are released for joiners; the outputs go out."""
        for job, token, score in tokens:
            if job.finished or job.cancelled.is_set():
                if not job.finished:
                    self.outputs.end(job)
                batch.release(job)
                continue
            if not job.generated:
                trace.first_token(job)
            if token in eos:
                self.outputs.end(job, "stop")
            else:
                job.generated.append(token)
                self.outputs.token(job, token, score)
                if job.budget_left <= 0:
                    self.outputs.end(job, "length")
            if job.finished:
                batch.release(job)
        self.outputs.flush()


def _slot_request(job: Job) -> SlotRequest:
    """The job as a row's request: its prompt and the tokens it already has (a stopped batch's), its budget left."""
    return SlotRequest(job.prompt_ids + job.generated, job.budget_left, job)
