"""The engine core under hostile or bursty traffic, over a stand-in model (`fakes.py`): batch shapes never exceed
what each request was admitted for, whatever the arrival pattern, stops and resumes; a failing request fails alone;
an unload is never starved."""

import random
import threading
import time

import pytest

from devmap.serving.core import EngineCore
from devmap.serving.errors import EngineGone, GenerationFailed, ModelUnloading
from devmap.serving.jobs import GenerationParams, Job
from devmap.serving.limits import EngineLimits
from devmap.serving.registry import ModelRegistry

from .fakes import Collected, FakeBatches, alone, fake_resident

_ids = iter(range(1, 1 << 30))


def core_over(batches: FakeBatches, limits: EngineLimits, context: int = 256, rows: int = 64):
    registry = ModelRegistry()
    registry.add(fake_resident(context=context, rows=rows))
    collected = Collected()
    core = EngineCore(registry, limits, collected, batches=batches)
    core.start()
    return core, collected


def request(prompt: list[int], budget: int, temperature: float = 0.0) -> Job:
    return Job(next(_ids), "m", prompt, GenerationParams(max_new_tokens=budget, temperature=temperature))


def test_two_waves_of_requests_within_the_context_all_finish():
    """The pattern that made every request fail with a context error: a wave of short requests with large budgets,
    a second wave while the first is half done (its batch stops to grow, and resumes with requests of several
    lengths so far)."""
    batches = FakeBatches(delay=0.001)
    core, collected = core_over(batches, EngineLimits(max_prompt_tokens=64, max_new_tokens=200))
    try:
        first = [request([5, 6, 7], 200) for _ in range(16)]
        for job in first:
            core.add(job)
        deadline = time.monotonic() + 30
        while len(collected.tokens.get(first[0].id, [])) < 60 and time.monotonic() < deadline:
            time.sleep(0.005)
        second = [request([8, 9, 10], 200) for _ in range(48)]
        for job in second:
            core.add(job)
        assert collected.wait([j.id for j in first + second], 60)
    finally:
        core.close(30)
    for job in first + second:
        assert not isinstance(collected.ended[job.id], Exception), collected.ended[job.id]
        assert collected.tokens[job.id] == alone(job.prompt_ids, 200)
    assert max(cache for _, _, cache in batches.shapes) <= 256
    assert core.metrics.preemptions._value.get() >= 1  # the first batch did stop and resume
    labels = {"stage": "0", "device": "cuda:0"}  # the stand-in's sampled windows reach /metrics
    assert core.metrics.stage_busy.labels(**labels)._value.get() == 0.5
    assert core.metrics.stage_sampled_seconds.labels(**labels)._value.get() >= 1.0


def test_any_arrival_pattern_gives_every_request_its_own_tokens():
    """Property: waves of requests (prompt + max_tokens within the context; greedy and sampled keys, which stop each
    other's batches; budgets, lengths and gaps of every size) all finish without an error, each with the tokens it
    gets alone, and no batch is longer than the context."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    wave = st.tuples(st.integers(0, 20), st.integers(1, 12), st.integers(1, 64), st.integers(1, 250),
                     st.booleans())

    @hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
    @hypothesis.given(waves=st.lists(wave, min_size=1, max_size=4), max_batch=st.sampled_from([4, 8, 64]),
                      kv_rows=st.sampled_from([2, 8, 64]), seed=st.integers(0, 1000))
    def check(waves, max_batch, kv_rows, seed):
        rng = random.Random(seed)
        limits = EngineLimits(max_batch=max_batch, max_prompt_tokens=64, max_new_tokens=250, join_wait=0.001,
                              preempt_after=0.002, batch_wait=0.001, max_batch_wait=0.003)
        batches = FakeBatches(delay=0.0002)
        core, collected = core_over(batches, limits, rows=kv_rows)
        jobs = []
        try:
            for gap_ms, count, prompt_len, budget, sampled in waves:
                time.sleep(gap_ms / 1000)
                for _ in range(count):
                    length = rng.randint(1, prompt_len)
                    job = request([rng.randint(3, 60) for _ in range(length)], min(budget, 256 - length),
                                  0.7 if sampled and rng.random() < 0.5 else 0.0)
                    jobs.append(job)
                    core.add(job)
            assert collected.wait([j.id for j in jobs], 60)
        finally:
            core.close(30)
        for job in jobs:
            assert not isinstance(collected.ended[job.id], Exception), collected.ended[job.id]
            assert collected.tokens[job.id] == alone(job.prompt_ids, job.params.max_new_tokens)
        assert all(first <= cache <= 256 for _, first, cache in batches.shapes)

    check()


def test_a_failing_request_fails_alone_and_its_neighbours_keep_their_tokens():
    """A request whose prompt makes its join step fail, joining a running batch together with an innocent one: both
    are suspects, each joins alone next, the failing one ends with a 500 naming the cause, and every other request
    (those running, the innocent joiner) finishes with the tokens it gets alone."""
    poison = 1  # never a generated token (those are 3 and up)
    batches = FakeBatches(fail_on=poison, delay=0.001)
    core, collected = core_over(batches, EngineLimits(join_wait=0.05))
    try:
        running = [request([5 + i, 6, 7], 120) for i in range(4)]
        for job in running:
            core.add(job)
        deadline = time.monotonic() + 30
        while len(collected.tokens.get(running[0].id, [])) < 20 and time.monotonic() < deadline:
            time.sleep(0.005)
        bad, innocent = request([9, poison, 9], 30), request([11, 12], 30)
        core.add(bad)
        core.add(innocent)
        everyone = running + [bad, innocent]
        assert collected.wait([j.id for j in everyone], 60)
    finally:
        core.close(30)
    error = collected.ended[bad.id]
    assert isinstance(error, GenerationFailed) and error.status == 500 and "IndexError" in error.message
    for job in running + [innocent]:
        assert not isinstance(collected.ended[job.id], Exception), collected.ended[job.id]
        assert collected.tokens[job.id] == alone(job.prompt_ids, job.params.max_new_tokens)
    assert innocent.alone and innocent.strikes == 1 and bad.strikes >= 1


def test_a_step_that_fails_without_a_joiner_ends_its_batch_with_the_reason():
    batches = FakeBatches()
    core, collected = core_over(batches, EngineLimits())
    original = batches.open

    def failing_open(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    batches.open = failing_open
    try:
        job = request([5, 6], 8)
        core.add(job)
        assert collected.wait([job.id], 30)
        error = collected.ended[job.id]
        assert isinstance(error, GenerationFailed) and "illegal memory access" in error.message
        batches.open = original  # the service goes on
        later = request([5, 6], 8)
        core.add(later)
        assert collected.wait([later.id], 30) and collected.tokens[later.id] == alone([5, 6], 8)
    finally:
        core.close(30)


def test_the_engines_end_reaches_every_request_as_503_with_its_reason():
    # a split service's batch meeting a shard process that has ended: 503 and why, never a 500
    batches = FakeBatches()
    core, collected = core_over(batches, EngineLimits())
    gone = EngineGone("shard process 1 of 2 ended (exit code -9): restart the service")

    def failing_open(*args, **kwargs):
        raise gone

    batches.open = failing_open
    try:
        jobs = [request([5, 6], 8), request([7], 4)]
        for job in jobs:
            core.add(job)
        assert collected.wait([job.id for job in jobs], 30)
        for job in jobs:
            error = collected.ended[job.id]
            assert isinstance(error, EngineGone) and error.status == 503 and "shard process 1" in error.message
    finally:
        core.close(30)


def test_an_unload_is_not_starved_by_clients_that_keep_coming():
    """Clients requesting the model back to back: the unload refuses new requests at once (503), lets running ones
    finish within its drain bound, ends the rest with a 503 and answers within that bound (plus a step)."""
    batches = FakeBatches(delay=0.002)
    limits = EngineLimits(unload_drain=0.5)
    core, collected = core_over(batches, limits)
    stop = threading.Event()
    refused: list[Exception] = []

    def client() -> None:
        while not stop.is_set():
            job = request([5, 6, 7], 200)
            try:
                core.registry.get("m")  # the API side's check: new work for the model
            except ModelUnloading as exc:
                refused.append(exc)
                return
            core.add(job)
            collected.wait([job.id], 30)

    threads = [threading.Thread(target=client) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        began = time.monotonic()
        core.unload("m")
        took = time.monotonic() - began
        stop.set()
        for thread in threads:
            thread.join(30)
    finally:
        core.close(30)
    assert took < limits.unload_drain + 5, took
    assert core.registry.all() == [] and len(refused) == 6
    cut = [e for e in collected.ended.values() if isinstance(e, Exception)]
    assert all(isinstance(e, ModelUnloading) and e.status == 503 for e in cut)
