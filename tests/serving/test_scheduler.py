"""The serving scheduler's policy, without a model, a thread or a clock: who starts a batch, who joins a running
one, when a batch stops for others, waits for clients coming back, or drains; and the shapes batches get."""

import pytest

from devmap.serving.jobs import GenerationParams, Job
from devmap.serving.kv_budget import KVBudget
from devmap.serving.scheduler import (MIN_ROWS, Admission, BatchShape, RunningBatch, Scheduler, SchedulerLimits,
                                      Start, Wait, batch_shape, grown, key_of)

LIMITS = SchedulerLimits(max_batch=8, batch_wait=0.005, max_batch_wait=0.05, length_bucket=32, join_wait=0.01,
                         join_tokens=20, preempt_after=0.25)
GREEDY = GenerationParams(max_new_tokens=8, temperature=0)


_ids = iter(range(1, 1 << 30))


def job(at: float, prompt: int = 4, params: GenerationParams = GREEDY, model: str = "m") -> Job:
    return Job(next(_ids), model, list(range(5, 5 + prompt)), params, arrived=at, waiting_since=at)


def scheduler(*jobs: Job) -> Scheduler:
    s = Scheduler(LIMITS)
    for j in jobs:
        s.add(j)
    return s


def running(first: Job, rows: int = 4, slot: int = 32, cache: int = 128, joiners: bool = True) -> RunningBatch:
    return RunningBatch(key_of(first), BatchShape(rows, slot, cache), joiners)


def test_a_batch_starts_once_requests_stop_coming_with_the_oldest_requests_key():
    a, b, other = job(1.0), job(1.002), job(1.001, model="n")
    s = scheduler(a, other, b)
    assert s.start(1.003, last_done=0.0) == Wait(1.002 + LIMITS.batch_wait)
    started = s.start(1.0071, last_done=0.0)
    assert isinstance(started, Start) and started.jobs == [a, b] and started.takes_joiners
    assert s.start(0.5, last_done=0.0) == Wait(1.002 + LIMITS.batch_wait)  # nothing is taken until the engine says


def test_a_batch_waits_at_most_max_batch_wait_and_starts_at_once_when_full_or_continuing():
    steady = [job(1.0 + 0.004 * k) for k in range(5)]  # one every 4 ms: never quiet for batch_wait
    s = scheduler(*steady)
    assert isinstance(s.start(1.0161, last_done=0.0), Wait)
    assert isinstance(s.start(1.0 + LIMITS.max_batch_wait, last_done=0.0), Start)
    assert isinstance(s.start(1.0161, last_done=1.02), Wait)  # the bound counts from the last batch's end too
    full = scheduler(*[job(1.0) for _ in range(LIMITS.max_batch + 2)])
    started = full.start(1.0, last_done=0.0)
    assert isinstance(started, Start) and len(started.jobs) == LIMITS.max_batch
    back = scheduler(job(1.0))
    back.put_back([job(0.5)], now=1.0)
    assert isinstance(back.start(1.0, last_done=0.0), Start)


def test_cancelled_requests_never_start():
    gone, kept = job(1.0), job(1.0)
    gone.cancelled.set()
    s = scheduler(gone, kept)
    assert s.cancelled() == [gone]
    started = s.start(2.0, last_done=0.0)
    assert isinstance(started, Start) and started.jobs == [kept]


def test_joiners_take_free_rows_within_the_join_token_budget():
    first = job(0.0)
    waiting = [job(1.0, prompt=8) for _ in range(4)]
    s = scheduler(*waiting)
    admission = s.admit(running(first), free=3, now=2.0)
    assert admission.joining == waiting[:2]  # 8 + 8 tokens; a third would pass join_tokens=20
    assert s.admit(running(first, rows=8), free=1, now=1.1).joining == waiting[:1]  # a full-size batch: one joins
    assert s.admit(running(first, rows=4), free=1, now=1.1).stop  # a batch that could be larger grows instead
    huge = job(1.0, prompt=30)
    assert scheduler(huge).admit(running(first), free=2, now=2.0).joining == [huge]  # the first always joins


def test_a_lone_joiner_waits_join_wait_for_company_unless_it_fills_the_free_rows():
    first = job(0.0)
    alone = job(1.0)
    assert scheduler(alone).admit(running(first), free=2, now=1.005) == Admission([])
    assert scheduler(alone).admit(running(first), free=2, now=1.0101).joining == [alone]
    assert scheduler(alone).admit(running(first), free=1, now=1.001).joining == [alone]


def test_a_batch_whose_steps_carry_prompts_takes_every_free_row_at_once():
    """Its steps pace the prompts (a step's prompt tokens): no join token budget here, and no wait for company."""
    first = job(0.0)
    waiting = [job(1.0, prompt=8) for _ in range(4)]
    riding = running(first)
    riding.riding = True
    assert scheduler(*waiting).admit(riding, free=3, now=1.001).joining == waiting[:3]


def test_a_request_that_cannot_join_stops_the_batch_after_preempt_after():
    first = job(0.0)
    for blocked in (job(1.0, model="n"), job(1.0, params=GenerationParams(max_new_tokens=8, temperature=0.5)),
                    job(1.0, prompt=40)):  # another model, another sampling, a prompt past the first slot
        assert scheduler(blocked).admit(running(first), free=2, now=1.1) == Admission([])
        assert scheduler(blocked).admit(running(first), free=2, now=1.0 + LIMITS.preempt_after).stop
    no_row = job(1.0)  # no free row while the batch could be larger: it grows after join_wait
    assert not scheduler(no_row).admit(running(first, rows=4), free=0, now=1.0 + LIMITS.join_wait / 2).stop
    assert scheduler(no_row).admit(running(first, rows=4), free=0, now=1.0 + LIMITS.join_wait).stop
    assert not scheduler(no_row).admit(running(first, rows=8), free=0, now=1.3).stop  # max_batch rows: it waits
    too_long = job(1.0, params=GenerationParams(max_new_tokens=200, temperature=0))
    assert scheduler(too_long).admit(running(first, cache=128), free=2, now=1.0).stop  # never fits: at once


def test_an_idle_batch_waits_for_its_clients_then_drains():
    first = job(0.0)
    batch = running(first)
    s = scheduler()
    assert s.admit(batch, free=4, now=5.0) == Admission([], wait_until=5.0 + LIMITS.max_batch_wait)
    assert s.admit(batch, free=4, now=5.02).wait_until == 5.0 + LIMITS.max_batch_wait  # idle since 5.0
    assert s.admit(batch, free=4, now=5.06) == Admission([])  # nobody came: it drains
    back = job(5.01)
    s.add(back)
    assert s.admit(running(first), free=4, now=5.012).wait_until == 5.01 + LIMITS.batch_wait  # more may follow
    assert s.admit(running(first), free=4, now=5.016).joining == [back]
    assert scheduler(job(5.0, model="n")).admit(running(first), free=4, now=5.0) == Admission([])  # others wait


def test_a_seeded_batch_takes_no_joiners_and_never_stops():
    seeded = GenerationParams(max_new_tokens=8, temperature=0.7, seed=3)
    first = job(0.0, params=seeded)
    s = scheduler(job(1.0, params=seeded), job(1.0, model="n"))
    assert s.admit(running(first, joiners=False), free=2, now=9.0) == Admission([])
    assert not scheduler().admit(running(first, joiners=False), free=4, now=9.0).wait_until


def test_batch_shapes_hold_every_request_and_settle_on_the_largest():
    jobs = [job(0.0, prompt=10), job(0.0, prompt=40, params=GenerationParams(max_new_tokens=100, temperature=0))]
    shape = batch_shape(jobs, LIMITS, context=0, kept=BatchShape())
    assert shape.rows == MIN_ROWS and shape.first_slot % 32 == 0 and shape.cache_len % 128 == 0
    assert shape.first_slot >= 40 + 100 - 1 and shape.cache_len >= shape.first_slot + 100
    again = batch_shape(jobs[:1], LIMITS, context=0, kept=grown(BatchShape(), shape))
    assert again == shape  # a later, smaller batch keeps the model's shape (and its captured steps)
    assert batch_shape(jobs, LIMITS, context=0, kept=BatchShape(), takes_joiners=False).rows == 2
    tight = batch_shape(jobs, LIMITS, context=160, kept=BatchShape())
    assert tight.cache_len <= 160 and tight.first_slot >= 40 and tight.cache_len - tight.first_slot + 1 >= 100


def test_any_requests_fit_the_shape_they_get():
    """Property: whatever the prompts, budgets, progress, context and kept shape, each request's prompt so far fits
    the first slot and its budget left fits the cache after it (what the continuous batch checks)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
    @hypothesis.given(items=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(0, 299)),
                                     min_size=1, max_size=9),
                      context=st.sampled_from([0, 700, 1024]), kept=st.tuples(st.integers(0, 16),
                                                                              st.integers(0, 400),
                                                                              st.integers(0, 900)))
    def check(items, context, kept):
        jobs = []
        for prompt, budget, done in items:
            j = job(0.0, prompt=prompt, params=GenerationParams(max_new_tokens=budget, temperature=0))
            j.generated = [7] * min(done, budget - 1)
            if context and prompt + budget > context:
                continue  # the engine refuses these at the door
            jobs.append(j)
        hypothesis.assume(jobs)
        shape = batch_shape(jobs, LIMITS, context, BatchShape(*kept))
        for j in jobs:
            length = len(j.prompt_ids) + len(j.generated)
            assert length <= shape.first_slot and j.budget_left <= shape.cache_len - length + 1
        assert shape.first_slot <= shape.cache_len and (not context or shape.cache_len <= context)
        assert min(len(jobs), LIMITS.max_batch) <= shape.rows <= LIMITS.max_batch

    check()


def test_a_kv_budget_holds_more_rows_of_shorter_caches():
    """A model whose plan made room for 2 rows of 512 cache tokens holds 8 rows of 128: its batches get the rows
    their cache length allows, and a request finding no row grows a batch only while the budget allows more."""
    budget = KVBudget(rows=2, cache_len=512)
    assert budget.tokens == 1024 and budget.rows_at(128) == 8 and budget.rows_at(512) == 2 and budget.rows_at(300) == 3
    many = [job(0.0, prompt=4) for _ in range(12)]
    for j in many:
        j.kv_budget = budget
    short = batch_shape(many, LIMITS, context=0, kept=BatchShape())
    assert short.cache_len == 128 and short.rows == 8  # max_batch=8 and the budget's 8 rows at 128
    long = [job(0.0, prompt=200, params=GenerationParams(max_new_tokens=100, temperature=0)) for _ in range(4)]
    for j in long:
        j.kv_budget = budget
    wide = batch_shape(long, LIMITS, context=0, kept=short)
    assert wide.cache_len == 512 and wide.rows == 2  # the kept 8 rows do not fit this cache
    s = scheduler(*many[2:4])
    assert not s.admit(RunningBatch(key_of(many[0]), BatchShape(2, 384, 512), True), free=0, now=1.0).stop
    assert s.admit(RunningBatch(key_of(many[0]), BatchShape(4, 32, 128), True), free=0, now=1.0).stop


def test_a_batch_in_lanes_holds_max_batch_rows_per_lane():
    """A model whose batches run in 2 lanes (two pipeline stages) takes 2 × max_batch rows: each stage works on a
    lane as full as a one-GPU batch; the KV budget still bounds them."""
    many = [job(0.0, prompt=4) for _ in range(20)]
    for j in many:
        j.kv_budget = KVBudget(rows=16, cache_len=128, lanes=2)
    assert batch_shape(many, LIMITS, context=0, kept=BatchShape()).rows == 16  # 2 lanes × max_batch 8
    assert batch_shape(many[:5], LIMITS, context=0, kept=BatchShape()).rows == 16  # a lane for them, one for joiners
    assert batch_shape(many[:5], LIMITS, context=0, kept=BatchShape(), takes_joiners=False).rows == 8
    started = scheduler(*many).start(1.0, last_done=0.0)
    assert isinstance(started, Start) and len(started.jobs) == 16
    for j in many:
        j.kv_budget = KVBudget(rows=12, cache_len=128, lanes=2)
    assert batch_shape(many, LIMITS, context=0, kept=BatchShape()).rows == 12  # the budget's rows at most
    for j in many:
        j.kv_budget = KVBudget(rows=64, cache_len=128, lanes=1)
    assert batch_shape(many, LIMITS, context=0, kept=BatchShape()).rows == 8  # one lane: max_batch


def test_the_join_token_limit_holds_at_its_boundary():
    """join_tokens=20: a first joiner of 8 tokens and a second of 12 make exactly 20 and join together; a second of
    13 waits for the next step."""
    first = job(0.0)
    exact = [job(1.0, prompt=8), job(1.0, prompt=12)]
    assert scheduler(*exact).admit(running(first), free=3, now=2.0).joining == exact
    over = [job(1.0, prompt=8), job(1.0, prompt=13)]
    assert scheduler(*over).admit(running(first), free=3, now=2.0).joining == over[:1]


def test_a_request_that_exactly_fits_the_cache_joins_and_one_token_more_stops_the_batch():
    """A batch decoding from slot 32 with a cache of 128 holds 128 - 32 + 1 = 97 new tokens for any prompt that fits
    its slot: a budget of 97 joins, 98 never fits (the batch stops at once, so that a new one holds it)."""
    first = job(0.0)
    fits = job(1.0, prompt=32, params=GenerationParams(max_new_tokens=97, temperature=0))
    assert scheduler(fits).admit(running(first, slot=32, cache=128), free=2, now=2.0).joining == [fits]
    longer = job(1.0, prompt=33, params=GenerationParams(max_new_tokens=8, temperature=0))
    assert scheduler(longer).admit(running(first, slot=32, cache=128), free=2, now=1.0) == Admission([])
    never = job(1.0, prompt=4, params=GenerationParams(max_new_tokens=98, temperature=0))
    assert scheduler(never).admit(running(first, slot=32, cache=128), free=2, now=1.0).stop


def test_a_shape_at_the_context_holds_a_request_of_exactly_the_context():
    """prompt + max_tokens == the context is admitted at the door, so its batch holds it (its last token is never
    written back), after any number of tokens it had before its batch stopped."""
    for done in (0, 1, 50, 99):
        j = job(0.0, prompt=156, params=GenerationParams(max_new_tokens=100, temperature=0))
        j.generated = [7] * done
        other = job(0.0, prompt=3, params=GenerationParams(max_new_tokens=200, temperature=0))
        shape = batch_shape([j, other], LIMITS, context=256, kept=BatchShape())
        assert shape.cache_len <= 256
        for each in (j, other):
            length = len(each.prompt_ids) + len(each.generated)
            assert length <= shape.first_slot and each.budget_left <= shape.cache_len - length + 1


def test_a_request_of_a_failed_step_starts_and_joins_alone():
    first = job(0.0)
    suspect, other = job(1.0), job(1.0)
    suspect.alone = True
    started = scheduler(suspect, other).start(9.0, last_done=0.0)
    assert isinstance(started, Start) and started.jobs == [suspect]
    assert scheduler(other, suspect).start(9.0, last_done=0.0).jobs == [other]  # nobody starts with it
    assert scheduler(suspect, other).admit(running(first), free=3, now=2.0).joining == [suspect]
    assert scheduler(other, suspect).admit(running(first), free=3, now=2.0).joining == [other]


def test_requests_whose_prompts_are_scored_take_no_joiners():
    echo = GenerationParams(max_new_tokens=8, temperature=0, logprobs=1, echo=True)
    started = scheduler(job(1.0, params=echo), job(1.0, params=echo)).start(9.0, last_done=0.0)
    assert isinstance(started, Start) and not started.takes_joiners and len(started.jobs) == 2
    assert key_of(job(1.0, params=echo)) != key_of(job(1.0))  # nor do they join a batch of unscored requests
