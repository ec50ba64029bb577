"""The engine's continuous batches: between two decode steps, a running batch's free rows take waiting requests of
the same model and sampling (devmap.generation.continuous), so a request starts within a step or two instead of
waiting for the batch to end; at most `join_tokens` prompt tokens join at one step. A batch's cache columns wrap
around, so it runs as long as requests come. A request that cannot join (another model or sampling, no free row)
stops the batch once it has waited `preempt_after`; one larger than the batch's shape stops it at once. The stopped
batch's unfinished requests continue in a later one, their prompt and tokens so far prefilled again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..generation.continuous import SlotRequest, generate_continuous
from ..generation.sampling import Sampling
from .jobs import GenerationParams, Job
from .text_stream import eos_ids, take_token
from .registry import ResidentModel

log = logging.getLogger("devmap.serving")
SLOW_FIRST_TOKEN = 0.25  # seconds: a request slower than this to its first token is logged with its phases (debug)

MIN_ROWS = 8  # rows of the smallest continuous batch: room for a few joiners at about one row's step time
CACHE_BUCKET = 128  # cache lengths come in multiples of this, so a service sees few captured step shapes


def continuous_possible(params: GenerationParams) -> bool:
    """Seeded sampling runs as whole batches: a request's tokens then depend only on its batch, not on joiners."""
    return params.temperature == 0 or params.seed is None


def batch_shape(jobs: list[Job], max_batch: int, length_bucket: int, resident: ResidentModel) -> tuple[int, int, int]:
    """(rows, first slot, cache length) of a continuous batch starting with `jobs`: rows a power of two; decoding
    from a slot past the longest prompt (plus max_tokens) the model's batches have had, in multiples of
    `length_bucket` (so that such prompts can join); a cache of that plus the longest max_tokens (each request's
    prompt and tokens fit it; its columns wrap around), in multiples of CACHE_BUCKET, within the model's context.
    None of the three shrinks below the model's largest batch so far: a service settles on one shape, whose steps
    are captured once and replayed from then on (a new shape costs captures)."""
    count = len(jobs)
    rows = max(count, min(max_batch, max(MIN_ROWS, 1 << (count - 1).bit_length(), resident.batch_rows)))
    longest = max(len(j.prompt_ids) + len(j.generated) for j in jobs)
    most = max(j.params.max_tokens - len(j.generated) for j in jobs)
    span = max(j.params.max_tokens for j in jobs)
    # past the longest prompt plus its tokens: when a batch stops for another model's requests, its requests
    # continue from prompt + tokens so far, which then still fit the slot (a slot that grows costs new captures)
    fresh = max(len(j.prompt_ids) for j in jobs) + span - 1
    slot = max(round_up(max(longest, fresh), length_bucket), resident.batch_slot)
    cache = max(round_up(slot + span, CACHE_BUCKET), resident.batch_cache)
    if resident.context:
        cache = min(cache, resident.context)
        if most > cache - slot + 1:  # the buckets never cost a request its tokens (the engine's check fits it)
            slot = longest
    cache = max(cache, slot + most - 1)
    resident.batch_rows = max(rows, resident.batch_rows)
    resident.batch_slot, resident.batch_cache = max(slot, resident.batch_slot), max(cache, resident.batch_cache)
    return rows, slot, cache


def serve_continuous(engine: Any, resident: ResidentModel, jobs: list[Job]) -> list[Job]:
    """Run `jobs` as a continuous batch of the `Engine`, taking in its waiting requests as rows free up (each is
    appended to `jobs`); returns the unfinished requests when the batch was stopped for others."""
    limits, metrics = engine.limits, engine.metrics
    key = _key(jobs[0])
    eos = eos_ids(resident)
    rows, slot, cache_len = batch_shape(jobs, limits.max_batch, limits.length_bucket, resident)
    params = jobs[0].params
    sampling = Sampling(params.temperature != 0, params.temperature or 1.0, params.top_k, params.top_p,
                        params.seed or 0)
    started, stats = time.perf_counter(), {}

    def admit(free: int, longest: int, most: int) -> list[SlotRequest] | None:
        engine.drain_queue()
        if free == rows and not any(_key(job) == key for job in engine.waiting if not job.cancelled.is_set()):
            # every row is free: the clients that just got their answers are likely on their way back; waiting a
            # little for them keeps the batch and its captured steps instead of draining it and starting anew
            if engine.await_request(limits.max_batch_wait):
                while len(engine.waiting) < rows and engine.await_request(limits.batch_wait):
                    pass
        now = time.perf_counter()
        chosen: list[Job] = []
        tokens, budget = 0, limits.join_tokens
        for job in engine.waiting:
            if job.cancelled.is_set():
                continue
            same = _key(job) == key
            if same and job.params.max_tokens - len(job.generated) > most:
                return None  # it never fits this batch's cache: a new batch, now
            length = len(job.prompt_ids) + len(job.generated)
            if same and len(chosen) < free and length <= longest and (not chosen or tokens + length <= budget):
                chosen.append(job)
                tokens += length
                continue
            # what waits for the budget joins at a later step; what needs a row none frees soon enough (the batch
            # could grow), a longer prompt than the batch's shape takes, or another model or sampling stops it
            blocked = not same or length > longest or (len(chosen) >= free and rows < limits.max_batch)
            if blocked and now - job.waiting_since >= limits.preempt_after:
                return None
        taken = {id(j) for j in chosen}  # identity: jobs compare by value
        full = len(chosen) == free or any(id(j) not in taken and _key(j) == key
                                          for j in engine.waiting if not j.cancelled.is_set())
        if chosen and not full and free < rows and now - min(j.waiting_since for j in chosen) < limits.join_wait:
            chosen = []  # a little longer for more of them: one prefill for all (its cost hardly depends on rows)
        if chosen:
            engine.take(chosen)
            for job in chosen:
                admitted[id(job)] = (now, free)
            jobs.extend(chosen)
            metrics.joined.inc(len(chosen))
        metrics.running.set(rows - free + len(chosen))
        return [_request(job) for job in chosen]

    slowest = [0.0]  # the longest wait for a first token in this batch (debug log)
    admitted: dict[int, tuple[float, int]] = {}  # id(job): when it was taken into the batch, rows free then

    def emit(job: Job, token: int) -> bool:
        if not job.finished and not job.cancelled.is_set():
            if not job.generated:
                now = time.perf_counter()
                slowest[0] = max(slowest[0], now - job.arrived)
                taken, free = admitted.pop(id(job), (started, rows))  # its first token: no longer needed
                if now - job.arrived > SLOW_FIRST_TOKEN and log.isEnabledFor(logging.DEBUG):
                    log.debug("slow first token (%.0f ms): a %d-token prompt waited %.0f ms to join (%d rows free "
                              "then; %.0f ms into the batch), then %.0f ms to its first token",
                              1000 * (now - job.arrived), len(job.prompt_ids) + len(job.generated),
                              1000 * (taken - job.arrived), free, 1000 * (taken - started), 1000 * (now - taken))
            take_token(job, token, resident, eos, metrics)
        return job.finished or job.cancelled.is_set()

    left = generate_continuous(resident.model, [_request(job) for job in jobs], admit, emit, rows=rows,
                               first_slot=slot, cache_len=cache_len, lanes=limits.lanes, sampling=sampling,
                               compile=limits.compile, stats=stats)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("continuous batch (rows %d, first slot %d, cache %d): %d requests, %d joined (issued in %.0f ms), "
                  "slowest first token %.0f ms, %s after %d steps, %.0f ms", rows, slot, cache_len, len(jobs),
                  stats["joined"], 1000 * stats["join_seconds"], 1000 * slowest[0],
                  "stopped" if left else "drained", stats["steps"], 1000 * (time.perf_counter() - started))
    return [job for job in left if not job.finished and not job.cancelled.is_set()]


def _key(job: Job) -> tuple:
    """Requests of one key can share a batch: the same model and sampling settings."""
    return job.model_id, job.params.batch_key()


def _request(job: Job) -> SlotRequest:
    """The job as a row's request: its prompt and the tokens it already has (a stopped batch's), what it may add."""
    return SlotRequest(job.prompt_ids + job.generated, job.params.max_tokens - len(job.generated), job)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (unchanged for 0 or 1)."""
    return -(-value // multiple) * multiple if multiple > 1 else value
