"""Who runs next: the serving engine's policy, apart from time, threads and models.

The engine's loop owns the clock, the request queue and the model; at each decision it asks the `Scheduler`:
- `start(now, last_done)`: with no batch running, which waiting requests start one now (or how long to wait for
  more: clients that just got their answers come back together, spread over tens of milliseconds);
- `admit(batch, free, now)`: between two decode steps of a running continuous batch, which waiting requests take
  its free rows now, whether the batch stops for requests that cannot join it, and, once every row is free,
  how long to wait for more before it ends.
Every answer is a value computed from the waiting requests, the batch and `now`; nothing here blocks or reads a
clock, so the policy is tested without a model (`tests/serving/test_scheduler.py`).

One batching mode: continuous batches. Greedy and unseeded sampled requests join a running batch of the same model
and sampling; a seeded batch takes no joiners and never stops early (a request's tokens then depend only on the
requests it started with), nor does a batch of requests that asked for their prompts' scores (they are scored before
the batch starts). A request that was among several joiners of a failed step joins alone from then on: it starts a
batch alone, and is the one joiner of its step (`batch_run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from .jobs import Job

MIN_ROWS = 8  # rows of the smallest continuous batch: room for a few joiners at about one row's step time
CACHE_BUCKET = 128  # cache lengths come in multiples of this, so a service sees few captured step shapes


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduling knobs (seconds and counts), from the engine's limits."""

    max_batch: int = 64
    batch_wait: float = 0.005  # a batch takes requests until none came for this long
    max_batch_wait: float = 0.05  # but starts at the latest this long after its oldest request or the last batch
    length_bucket: int = 32  # a batch's first slot is a multiple of this
    join_wait: float = 0.01  # requests that could join wait up to this long for more to join with them
    join_tokens: int = 2048  # prompt tokens that join at one step, at most (beyond the first request)
    # (both for batches whose joiners prefill on their own: where the decode steps carry joiners' prompts, every free
    # row is taken at once and the batch paces the prompts itself, `devmap.generation.mixed_joins`)
    preempt_after: float = 0.25  # a request that cannot join stops the running batch once it has waited this long


@dataclass(frozen=True)
class BatchShape:
    """A continuous batch's rows, the slot its lanes decode from (the longest prompt it takes) and its cache
    length; a model keeps the largest shape so far (zeros: none yet), so that its batches settle on one shape."""

    rows: int = 0
    first_slot: int = 0
    cache_len: int = 0


@dataclass(frozen=True)
class Start:
    """Start a batch of these requests now (oldest first)."""

    jobs: list[Job]
    takes_joiners: bool


@dataclass(frozen=True)
class Wait:
    """Nothing to start yet: wait for a request until `until` (perf_counter seconds; None: until one comes)."""

    until: float | None


@dataclass(frozen=True)
class Admission:
    """What a running batch does before its next step: `joining` take free rows; `stop` ends the batch now (its
    unfinished requests wait to continue); `wait_until` (only with every row free): wait for requests until then
    and ask again, instead of ending the batch."""

    joining: list[Job]
    stop: bool = False
    wait_until: float | None = None


@dataclass
class RunningBatch:
    """What the scheduler knows of the running batch: its requests' key, shape, whether it takes joiners, whether its
    decode steps carry their prompts (`riding`), and since when every row has been free (None while some row is
    held)."""

    key: Hashable
    shape: BatchShape
    takes_joiners: bool
    idle_since: float | None = None
    riding: bool = False


def key_of(job: Job) -> Hashable:
    """Requests of one key can share a batch: the same model and sampling settings."""
    return job.model_id, job.params.batch_key()


def takes_joiners(job: Job) -> bool:
    """Seeded sampling admits no joiners (a request's tokens then depend only on the batch it started in), nor do
    requests whose prompts are scored (echo), which happens before their batch starts."""
    return (job.params.temperature == 0 or job.params.seed is None) and not job.params.echo


def most_rows(job: Job, limits: SchedulerLimits, cache_len: int | None = None) -> int:
    """The most rows a batch of the job's model takes: the service's `max_batch` per lane of the model's batches, or
    fewer where its KV budget holds fewer rows of `cache_len` tokens (None: of the longest cache its plan made room
    for)."""
    if job.kv_budget is None:
        return limits.max_batch
    rows = job.kv_budget.rows if cache_len is None else job.kv_budget.rows_at(cache_len)
    return min(limits.max_batch * job.kv_budget.lanes, rows)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (unchanged for 0 or 1)."""
    return -(-value // multiple) * multiple if multiple > 1 else value


def batch_shape(jobs: list[Job], limits: SchedulerLimits, context: int, kept: BatchShape,
                takes_joiners: bool = True) -> BatchShape:
    """The shape of a batch starting with `jobs` on a model of `context` tokens (0: unbounded) whose largest shape so
    far is `kept`: rows a power of two (at least MIN_ROWS when it takes joiners), as many as the model's KV budget holds
    at that cache length at most (the engine starts the first `rows` of `jobs`). A batch that takes joiners has that
    many rows in each of its model's lanes, and the requests spread evenly over the lanes (`ContinuousBatch.free_rows`).

    A row holds its request's tokens so far and the tokens it may still generate: `columns(job)` cache columns. The
    cache holds every starting row's columns, and is never longer than the context (a request admitted with prompt +
    max_tokens within the context always fits, however many tokens it had before its batch stopped). Within that, the
    shape leaves room for joiners as large as the starting requests were when they came: the lanes decode from a slot
    past the longest prompt plus max_new_tokens (so that a stopped request continuing from its tokens so far still
    fits), in multiples of `length_bucket`, with a cache of that plus the largest budget (its columns wrap around),
    in multiples of CACHE_BUCKET; where the context cuts that short, the slot moves back (never before the longest
    row's tokens) until the largest budget left fits a joiner. A batch that takes joiners never shrinks below `kept`:
    a service settles on one shape, whose steps are captured once and replayed. A seeded batch's rows depend on its
    requests alone (the sampled tokens depend on the rows)."""
    longest = max(len(j.prompt_ids) + len(j.generated) for j in jobs)
    longest_budget = max(j.budget_left for j in jobs)
    span = max(j.params.max_new_tokens for j in jobs)
    fresh = max(len(j.prompt_ids) for j in jobs) + span - 1
    slot = max(round_up(max(longest, fresh), limits.length_bucket), kept.first_slot)
    cache = max(round_up(slot + span, CACHE_BUCKET), kept.cache_len, max(columns(j) for j in jobs))
    if context:
        cache = min(cache, context)
        slot = max(longest, min(slot, cache - longest_budget + 1))
    fewest = 1 << (len(jobs) - 1).bit_length()
    most = most_rows(jobs[0], limits, cache)
    if not takes_joiners:
        return BatchShape(min(fewest, most), slot, cache)
    lanes = jobs[0].kv_budget.lanes if jobs[0].kv_budget is not None else 1
    return BatchShape(min(most, lanes * max(MIN_ROWS, fewest, kept.rows // lanes)), slot, cache)


def columns(job: Job) -> int:
    """The cache columns a request's row needs from now on: its tokens so far and the tokens it may still generate
    (the last of which is never written back)."""
    return len(job.prompt_ids) + len(job.generated) + job.budget_left - 1


def largest_cache(limits: SchedulerLimits, max_prompt_tokens: int, max_new_tokens: int, context: int) -> int:
    """The longest cache (tokens per row) any batch of a model of `context` tokens (0: unbounded) can have, for
    prompts of at most `max_prompt_tokens` and budgets of at most `max_new_tokens` (within the context): what a
    memory plan for serving must make room for, per row (`batch_shape` never exceeds it)."""
    slot = round_up(max_prompt_tokens + max_new_tokens - 1, limits.length_bucket)
    cache = round_up(slot + max_new_tokens, CACHE_BUCKET)
    return min(cache, context) if context else cache


def grown(kept: BatchShape, shape: BatchShape) -> BatchShape:
    """The largest of a model's kept shape and a new batch's."""
    return BatchShape(max(kept.rows, shape.rows), max(kept.first_slot, shape.first_slot),
                      max(kept.cache_len, shape.cache_len))


class Scheduler:
    """The waiting requests (oldest first, continuing ones after those that stopped their batch) and the policy
    over them. The engine adds requests, asks `start` or `admit`, and hands back what it took with `take`."""

    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.waiting: list[Job] = []

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def take(self, jobs: list[Job]) -> None:
        """These requests leave the waiting list (they start, or ended while waiting)."""
        chosen = {id(j) for j in jobs}  # identity: jobs compare by value
        self.waiting = [j for j in self.waiting if id(j) not in chosen]

    def put_back(self, jobs: list[Job], now: float) -> None:
        """Unfinished requests of a batch that stopped for others: they continue later, after those."""
        for job in jobs:
            job.resumed, job.waiting_since = True, now
        self.waiting.extend(jobs)

    def within_rows(self, jobs: list[Job], rows: int, now: float) -> list[Job]:
        """The first `rows` of a starting batch's requests (its shape's rows); the others wait to continue after
        them."""
        self.put_back(jobs[rows:], now)
        return jobs[:rows]

    def cancelled(self) -> list[Job]:
        """The waiting requests whose clients went away (the engine takes them out)."""
        return [j for j in self.waiting if j.cancelled.is_set()]

    def start(self, now: float, last_done: float) -> Start | Wait:
        """With no batch running: start the oldest waiting request with every other one of its key (up to
        max_batch) once none has come for `batch_wait`, or `max_batch_wait` after the later of its arrival and the
        last batch's end (`last_done`), or at once when continuing requests wait or the batch is full."""
        live = [j for j in self.waiting if not j.cancelled.is_set()]
        if not live:
            return Wait(None)
        first = live[0]
        key = key_of(first)
        most = most_rows(first, self.limits)
        same = [first] if first.alone else [j for j in live if key_of(j) == key and not j.alone][:most]
        latest = max(first.arrived, last_done) + self.limits.max_batch_wait
        quiet = max(j.arrived for j in live) + self.limits.batch_wait
        if any(j.resumed for j in live) or len(same) >= most or now >= min(latest, quiet):
            return Start(same, takes_joiners(first))
        return Wait(min(latest, quiet))

    def admit(self, batch: RunningBatch, free: int, now: float) -> Admission:
        """Before the running batch's next step, with `free` of its rows free: the waiting requests of its key that
        join now (as many as rows free, prompts within its first slot; unless the batch's steps carry their prompts,
        at most `join_tokens` prompt tokens beyond the first, and they wait up to `join_wait` for more to join with
        them unless they fill the free rows); a stop
        once a request that finds no row while the batch could be larger has waited `join_wait`, once one that
        cannot join (another key, a longer prompt than the batch takes) has waited `preempt_after`, or at once for
        one whose budget the cache cannot hold;
        with every row free and none to join, a wait of up to `max_batch_wait` for clients coming back."""
        limits, rows = self.limits, batch.shape.rows
        if free < rows:
            batch.idle_since = None
        elif batch.idle_since is None:
            batch.idle_since = now
        live = [j for j in self.waiting if not j.cancelled.is_set()]
        same = [j for j in live if key_of(j) == batch.key]
        if not batch.takes_joiners:  # a seeded batch runs to its end; the others wait for it
            return Admission([])
        if free == rows:
            idle_until = batch.idle_since + limits.max_batch_wait
            if not same:
                # nothing of its key: wait for its clients to come back, unless others wait to start their own
                return Admission([], wait_until=idle_until if now < idle_until and not live else None)
            newest = max(j.arrived for j in same) + limits.batch_wait
            if len(same) < rows and now < min(newest, idle_until):  # more of them are on their way back
                return Admission([], wait_until=min(newest, idle_until))
        chosen: list[Job] = []
        tokens = 0
        most = batch.shape.cache_len - batch.shape.first_slot + 1
        for job in live:
            if chosen and chosen[0].alone:  # the one joiner of its step
                break
            is_same = key_of(job) == batch.key
            if is_same and job.budget_left > most:
                return Admission([], stop=True)  # it never fits this batch's cache: a new batch, now
            length = len(job.prompt_ids) + len(job.generated)
            fits = length <= batch.shape.first_slot
            if is_same and fits and len(chosen) < free and (not chosen or not job.alone) and (
                    not chosen or batch.riding or tokens + length <= limits.join_tokens):
                chosen.append(job)
                tokens += length
                continue
            # what waits for the join token budget joins at a later step; one that finds no free row while the
            # batch could be larger stops it after `join_wait` (the next batch has more rows: a model's batches only
            # grow, so this happens a few times in a service's life, as vLLM admits sequences while KV room
            # remains); a longer prompt than the batch takes, or another key, stops it after `preempt_after`
            if is_same and fits and len(chosen) >= free and rows < most_rows(job, limits, batch.shape.cache_len):
                if now - job.waiting_since >= limits.join_wait:
                    return Admission([], stop=True)
            elif (not is_same or not fits) and now - job.waiting_since >= limits.preempt_after:
                return Admission([], stop=True)
        taken = {id(j) for j in chosen}
        full = len(chosen) == free or any(id(j) not in taken for j in same)
        if (chosen and not full and not batch.riding and free < rows and not chosen[0].alone
                and now - min(j.waiting_since for j in chosen) < limits.join_wait):
            # a little longer for more of them: one prefill for all (its cost hardly depends on rows)
            return Admission([])
        return Admission(chosen)
