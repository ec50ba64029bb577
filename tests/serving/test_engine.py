"""The engine in-process: a full queue, a client that goes away mid-stream, the per-request timeout, idle unloads."""

import asyncio

import pytest

from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry
from devmap.serving.errors import QueueFull, RequestTimeout, ServiceError, ShuttingDown


@pytest.fixture(scope="module")
def registry(model_root):
    registry = ModelRegistry(model_root, "auto", "cpu=2GB")
    registry.load(model_root / "tiny")
    return registry


def test_a_full_queue_refuses_with_429(registry):
    engine = Engine(registry, EngineLimits(max_queue=2))  # not started: nothing leaves the queue

    async def fill() -> None:
        for _ in range(2):
            engine.submit("tiny", [5, 6, 7], GenerationParams(max_new_tokens=2))
        with pytest.raises(QueueFull) as refused:
            engine.submit("tiny", [5, 6, 7], GenerationParams(max_new_tokens=2))
        assert refused.value.status == 429

    asyncio.run(fill())


def test_a_client_that_leaves_mid_stream_stops_its_batch(registry):
    engine = Engine(registry)
    engine.start()

    async def leave_early() -> int:
        job = engine.submit("tiny", [5, 6, 7], GenerationParams(max_new_tokens=200, temperature=0))
        stream = engine.stream(job)
        await stream.__anext__()
        await stream.aclose()  # what the server does when the client disconnects
        for _ in range(200):  # the worker notices at its next step and ends the generate call
            await asyncio.sleep(0.01)
            if not registry.get("tiny").busy.locked():
                break
        return len(job.generated)

    try:
        assert asyncio.run(leave_early()) < 200
        assert not registry.get("tiny").busy.locked()
    finally:
        engine.close(timeout=30)


def test_the_request_timeout_gives_504_and_closing_refuses_new_work(registry):
    engine = Engine(registry, EngineLimits(request_timeout=1e-4))
    engine.start()

    async def too_slow() -> None:
        with pytest.raises(RequestTimeout) as late:
            await engine.complete("tiny", [5, 6, 7], GenerationParams(max_new_tokens=50))
        assert late.value.status == 504

    try:
        asyncio.run(too_slow())
    finally:
        engine.close(timeout=30)

    async def after_close() -> None:
        with pytest.raises(ShuttingDown):
            engine.submit("tiny", [5], GenerationParams())

    asyncio.run(after_close())


def test_stop_strings_end_the_text_before_them(registry):
    """The free text's characters 3-4 as a stop string: the text ends right before their first appearance, with
    finish_reason "stop"; the stop string is never sent."""
    engine = Engine(registry)
    engine.start()

    async def run() -> tuple:
        free = await engine.complete("tiny", [5, 6, 7], GenerationParams(max_new_tokens=12, temperature=0))
        assert len(free.text) >= 5, free  # the tiny model's 12 tokens of text are longer than that
        stop = free.text[3:5]
        stopped = await engine.complete("tiny", [5, 6, 7], GenerationParams(max_new_tokens=12, temperature=0,
                                                                             stop=(stop,)))
        return free, stop, stopped

    try:
        free, stop, stopped = asyncio.run(run())
    finally:
        engine.close(timeout=30)
    assert stopped.text == free.text[:free.text.find(stop)] and stop not in stopped.text
    assert stopped.finish_reason == "stop" and free.finish_reason in ("stop", "length")


def test_idle_models_are_unloaded_and_paths_stay_under_the_root(model_root):
    registry = ModelRegistry(model_root, "auto", "cpu=2GB")
    engine = Engine(registry, EngineLimits(idle_timeout=0.01))
    registry.load(registry.under_root("second"))
    engine.start()

    async def wait_gone() -> None:
        for _ in range(300):
            await asyncio.sleep(0.01)
            if not registry.all():
                return

    try:
        asyncio.run(wait_gone())
        assert registry.all() == []
    finally:
        engine.close(timeout=30)
    for bad in ("..", "../models", "/tmp", "", "a/../../b"):
        with pytest.raises(ServiceError):
            registry.under_root(bad)
    assert ModelRegistry(model_root).remaining() is None


def test_shape_buckets_never_cost_a_request_its_tokens(registry):
    engine = Engine(registry, EngineLimits(length_bucket=32))
    engine.start()

    async def at_the_edge() -> tuple:
        prompt = [5 + i % 300 for i in range(200)]  # 200 + 56 = the model's whole context of 256
        done = await engine.complete("tiny", prompt, GenerationParams(max_new_tokens=56, temperature=0))
        small = await asyncio.gather(*(engine.complete("tiny", [5, 6, 7][: k + 1], GenerationParams(max_new_tokens=3,
                                                                                                     temperature=0))
                                       for k in range(3)))
        return done, small

    try:
        done, small = asyncio.run(at_the_edge())
    finally:
        engine.close(timeout=30)
    assert done.finish_reason == "stop" or done.completion_tokens == 56
    assert all(s.finish_reason == "stop" or s.completion_tokens == 3 for s in small)
    with pytest.raises(ServiceError, match="context"):
        engine.check(registry.get("tiny"), [5] * 200, GenerationParams(max_new_tokens=57))


def test_incremental_decoding_gives_the_whole_decode(registry):
    import asyncio as _asyncio

    from devmap.serving.text_stream import RequestStream, decode_new

    tokenizer = registry.get("tiny").tokenizer
    ids = tokenizer("héllo wörld ✓ the quick brown fox, (100) — ok", add_special_tokens=False)["input_ids"]
    job = RequestStream(1, "tiny", [1], GenerationParams(), tokenizer, _asyncio.new_event_loop())
    seen = []
    for token in ids:
        job.generated.append(token)
        decode_new(job, tokenizer)
        seen.append(job.text)
        assert "\ufffd" not in job.text  # a half character waits for its next byte
    decode_new(job, tokenizer, final=True)
    assert job.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("join_tokens, riding", [(2048, None), (8, None), (2048, True)],
                         ids=["joining apart", "one a step", "riding"])
def test_waiting_requests_join_a_running_batch_and_answers_stay_those_of_generate(registry, monkeypatch, join_tokens,
                                                                                 riding):
    """Continuous batching: requests that come while a long batch runs take its free rows between two steps (with
    join_tokens=8, about one per step), or ride its decode steps (`--ride`; a tiny model joins apart by default);
    every answer is the one devmap.generate gives alone."""
    import torch

    import devmap
    from devmap.generation.mixed_joins import Riding

    rides = []
    ride = Riding.ride
    monkeypatch.setattr(Riding, "ride", lambda self, *args: rides.append(1) or ride(self, *args))
    resident = registry.get("tiny")
    eos = list(resident.eos_ids)
    prompts = [[5 + (7 * i + k) % 300 for k in range(3 + i)] for i in range(10)]
    lengths = [40] + [6 + i for i in range(1, 10)]

    def alone(ids: list[int], new: int) -> str:
        out = devmap.generate(resident.model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(ids):].tolist()
        return resident.tokenizer.decode([t for t in out[:next((k for k, t in enumerate(out) if t in eos), len(out))]],
                                         skip_special_tokens=True)

    engine = Engine(registry, EngineLimits(max_batch=4, join_tokens=join_tokens, riding=riding))
    engine.start()

    async def staggered() -> list:
        long = engine.submit("tiny", prompts[0], GenerationParams(max_new_tokens=lengths[0], temperature=0))
        stream = engine.stream(long)
        text = await stream.__anext__()  # the long batch runs now: the others arrive while it does
        others = [asyncio.ensure_future(engine.complete("tiny", p, GenerationParams(max_new_tokens=n, temperature=0)))
                  for p, n in zip(prompts[1:], lengths[1:])]
        text += "".join([piece async for piece in stream])
        return [text, *[c.text for c in await asyncio.gather(*others)]]

    try:
        answers = asyncio.run(staggered())
    finally:
        engine.close(timeout=60)
    assert answers == [alone(p, n) for p, n in zip(prompts, lengths)]
    assert engine.core.core.metrics.joined._value.get() >= 1
    assert bool(rides) == bool(riding)


def test_a_batch_without_a_row_for_a_waiting_request_grows_and_answers_stay_those_of_generate(registry):
    """More requests than a running batch has rows (and room for more rows): it stops after join_wait and the next
    batch has rows for all of them; the requests it stopped continue with the answers they would have had alone."""
    import torch

    import devmap
    from devmap.serving.scheduler import MIN_ROWS
    resident = registry.get("tiny")
    resident.batch_shape = type(resident.batch_shape)()  # no kept shape: the first batch has MIN_ROWS rows
    eos = list(resident.eos_ids)
    count = MIN_ROWS + 4
    prompts = [[5 + (11 * i + k) % 300 for k in range(4 + i % 5)] for i in range(count)]

    def alone(ids: list[int], new: int) -> str:
        out = devmap.generate(resident.model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(ids):].tolist()
        return resident.tokenizer.decode([t for t in out[:next((k for k, t in enumerate(out) if t in eos), len(out))]],
                                         skip_special_tokens=True)

    engine = Engine(registry, EngineLimits(max_batch=2 * MIN_ROWS, preempt_after=60.0))  # growth alone stops it
    engine.start()

    async def crowd() -> list:
        first = engine.submit("tiny", prompts[0], GenerationParams(max_new_tokens=60, temperature=0))
        stream = engine.stream(first)
        text = await stream.__anext__()  # a batch of MIN_ROWS rows runs: the others find too few rows
        others = [asyncio.ensure_future(engine.complete("tiny", p, GenerationParams(max_new_tokens=30, temperature=0)))
                  for p in prompts[1:]]
        text += "".join([piece async for piece in stream])
        return [text, *[c.text for c in await asyncio.gather(*others)]]

    try:
        answers = asyncio.run(crowd())
    finally:
        engine.close(timeout=60)
    assert answers == [alone(prompts[0], 60), *[alone(p, 30) for p in prompts[1:]]]
    assert engine.core.core.metrics.preemptions._value.get() >= 1
    assert resident.batch_shape.rows == 2 * MIN_ROWS


def test_a_request_that_cannot_join_stops_a_continuous_batch(registry):
    """A seeded sampled request cannot join a greedy continuous batch: after preempt_after the batch stops, the
    sampled request runs, and the greedy one continues later with the answer it would have had alone."""
    import torch

    import devmap
    resident = registry.get("tiny")
    eos = list(resident.eos_ids)
    prompt = [5 + k for k in range(6)]
    out = devmap.generate(resident.model, torch.tensor([prompt]), max_new_tokens=120, eos_token_id=eos,
                          pad_token_id=eos[0])[0, len(prompt):].tolist()
    out = out[:next((k for k, t in enumerate(out) if t in eos), len(out))]
    engine = Engine(registry, EngineLimits(preempt_after=1e-3))
    engine.start()

    async def interleaved() -> tuple:
        long = engine.submit("tiny", prompt, GenerationParams(max_new_tokens=120, temperature=0))
        stream = engine.stream(long)
        text = await stream.__anext__()
        sampled = await engine.complete("tiny", [7, 8, 9], GenerationParams(max_new_tokens=4, temperature=0.7, seed=1))
        text += "".join([piece async for piece in stream])
        return text, sampled, long

    try:
        text, sampled, long = asyncio.run(interleaved())
    finally:
        engine.close(timeout=60)
    assert text == resident.tokenizer.decode(out, skip_special_tokens=True)
    assert sampled.finish_reason in ("stop", "length")
    assert len(out) > 40  # long enough to be running when the sampled request came: it was stopped for it
    assert engine.core.core.metrics.preemptions._value.get() >= 1


def test_unseeded_sampling_runs_in_a_continuous_batch(registry):
    """Sampled requests without a seed share continuous batches; each gets at most its max_tokens."""
    engine = Engine(registry, EngineLimits(max_batch=4))
    engine.start()

    async def sampled() -> list:
        params = [GenerationParams(max_new_tokens=3 + i, temperature=0.8, top_p=0.9, top_k=50) for i in range(6)]
        return await asyncio.gather(*(engine.complete("tiny", [5 + i, 6, 7], p) for i, p in enumerate(params)))

    try:
        done = asyncio.run(sampled())
    finally:
        engine.close(timeout=60)
    assert [d.finish_reason in ("stop", "length") for d in done] == [True] * 6
    assert all(d.completion_tokens <= 3 + i for i, d in enumerate(done))
    assert engine.core.core.metrics.joined._value.get() >= 1  # 6 requests, 4 rows: some joined a running batch


def test_the_debug_log_says_where_a_slow_first_token_waited(registry, monkeypatch, caplog):
    from devmap.serving import batch_trace

    monkeypatch.setattr(batch_trace, "SLOW_FIRST_TOKEN", 0.0)  # every first token counts as slow
    engine = Engine(registry)
    engine.start()

    async def ask() -> None:
        job = engine.submit("tiny", [5, 6, 7, 8], GenerationParams(max_new_tokens=3, temperature=0))
        async for _ in engine.stream(job):
            pass

    try:
        with caplog.at_level("DEBUG", logger="devmap.serving"):
            asyncio.run(ask())
    finally:
        engine.close(timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow first token")]
    assert lines and "a 4-token prompt waited" in lines[0] and "to its first token" in lines[0]


def test_garbage_collections_are_timed_while_the_engine_runs(registry, caplog):
    import gc
    import time

    from devmap.serving import gc_pauses

    engine = Engine(registry)
    engine.start()
    try:
        with caplog.at_level("DEBUG", logger="devmap.serving"):
            stop = gc_pauses.watch_gc_pauses(threshold=0.0)  # every collection logged
            for _ in range(20):  # gc.collect() does nothing while the engine's thread is in a collection of its own
                gc.collect()
                if any("(generation 2)" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.01)
            stop()
        gc.collect()
        text = engine.render_metrics().decode()
    finally:
        engine.close(timeout=30)
    assert any("garbage collector (generation 2) held every thread" in r.getMessage() for r in caplog.records)
    count = next(line for line in text.splitlines() if line.startswith("devmap_gc_pause_seconds_count"))
    assert float(count.split()[-1]) >= 2


def test_an_unloaded_model_is_freed_though_loads_freeze_the_collector(model_root):
    import gc
    import weakref

    registry = ModelRegistry(model_root, "auto", "cpu=2GB")
    resident = registry.load(model_root / "tiny", model_id="frozen")
    assert gc.get_freeze_count() > 0  # what was alive at the load is left out of later collections
    model = weakref.ref(resident.model)
    cycle = [resident.model]
    cycle.append(cycle)  # held by a reference cycle too: only the collector can free it
    gc.freeze()  # as the next load would: the cycle is frozen with the rest
    del resident, cycle
    registry.unload("frozen")
    assert model() is None


def test_a_seeded_request_gives_the_same_text_whatever_ran_before(registry):
    """A seeded batch's shape depends on its requests alone, not on the larger batches the model ran before."""
    engine = Engine(registry, EngineLimits(max_batch=8))
    engine.start()
    seeded = GenerationParams(max_new_tokens=6, temperature=0.9, seed=11)

    async def ask() -> list:
        first = await engine.complete("tiny", [5, 6, 7], seeded)
        await asyncio.gather(*(engine.complete("tiny", [9 + i, 8, 7], GenerationParams(max_new_tokens=40))
                               for i in range(8)))  # unseeded: a batch of 8 rows and a longer cache
        again = await engine.complete("tiny", [5, 6, 7], seeded)
        return [first.text, again.text]

    try:
        first, again = asyncio.run(ask())
    finally:
        engine.close(timeout=60)
    assert first == again


def test_two_waves_of_short_requests_with_large_budgets_all_finish(model_root):
    """16 requests of 3 tokens and max_tokens 200 on a 256-token model, then 48 more once the first are 60 tokens
    in: the first batch stops to grow and resumes with rows of several lengths so far; every request finishes."""
    registry = ModelRegistry(model_root, "auto", "cpu=2GB")
    limits = EngineLimits(max_prompt_tokens=64, max_new_tokens=200, request_timeout=120)
    engine = Engine(registry, limits)
    registry.load(model_root / "tiny", model_id="waves")
    engine.start()

    async def waves() -> list:
        greedy = GenerationParams(max_new_tokens=200, temperature=0)
        first = [engine.submit("waves", [5, 6, 7], greedy) for _ in range(16)]
        texts = [asyncio.ensure_future(_text(engine, job)) for job in first]
        while len(first[0].generated) < 60:
            await asyncio.sleep(0.005)
        second = [asyncio.ensure_future(engine.complete("waves", [8, 9, 10], greedy)) for _ in range(48)]
        rest = await asyncio.gather(*texts, *second, return_exceptions=True)
        return rest

    try:
        done = asyncio.run(waves())
    finally:
        engine.close(timeout=60)
    assert [d for d in done if isinstance(d, Exception)] == []
    assert engine.core.core.metrics.preemptions._value.get() >= 1


async def _text(engine, job) -> str:
    return "".join([piece async for piece in engine.stream(job)])


@pytest.mark.parametrize("riding", [None, True], ids=["joining apart", "riding"])
def test_a_request_whose_step_fails_fails_alone_and_the_batch_keeps_its_answers(registry, monkeypatch, riding):
    """A request whose prompt makes the model raise while it joins a running batch (injected: the embedding fails
    on one token id) gets a 500 naming the cause; the requests running beside it answer as devmap.generate does."""
    import torch

    import devmap
    from devmap.serving.errors import GenerationFailed

    resident = registry.get("tiny")
    eos = list(resident.eos_ids)
    poison = 499
    embedding = resident.model.get_input_embeddings()
    attribute = "_old_forward" if hasattr(embedding, "_old_forward") else "forward"  # past accelerate's hook
    forward = getattr(embedding, attribute)

    def failing(ids):
        if bool((ids == poison).any()):
            raise IndexError("index out of range in self")
        return forward(ids)

    prompts = [[5 + 17 * i % 300, 6, 7, 9] for i in range(4)]

    def alone(ids: list[int], new: int) -> str:
        out = devmap.generate(resident.model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=eos[0])[0, len(ids):].tolist()
        return resident.tokenizer.decode([t for t in out[:next((k for k, t in enumerate(out) if t in eos), len(out))]],
                                         skip_special_tokens=True)

    expected = [alone(p, 80) for p in prompts]
    monkeypatch.setattr(embedding, attribute, failing)
    engine = Engine(registry, EngineLimits(max_batch=8, request_timeout=120, riding=riding))
    engine.start()

    async def run() -> tuple:
        greedy = GenerationParams(max_new_tokens=80, temperature=0)
        jobs = [engine.submit("tiny", p, greedy) for p in prompts]
        texts = [asyncio.ensure_future(_text(engine, job)) for job in jobs]
        while len(jobs[0].generated) < 10:  # the batch runs: the failing request joins it
            await asyncio.sleep(0.005)
        bad = await asyncio.gather(engine.complete("tiny", [5, poison, 6], greedy), return_exceptions=True)
        return await asyncio.gather(*texts), bad[0]

    try:
        texts, bad = asyncio.run(run())
    finally:
        engine.close(timeout=60)
    assert isinstance(bad, GenerationFailed) and bad.status == 500 and "IndexError" in bad.message
    assert texts == expected


def test_a_config_only_directory_is_served_with_random_weights(tmp_path):
    """`devmap serve --load-format dummy`: a directory of configs and tokenizer alone is served with random weights
    made on its devices; without it the load says how."""
    import devmap

    devmap.save("llama-tiny", tmp_path / "bare", config_only=True)
    with pytest.raises(ServiceError, match="random_weights=True"):
        ModelRegistry(tmp_path, "auto", "cpu=2GB").load(tmp_path / "bare")
    registry = ModelRegistry(tmp_path, "auto", "cpu=2GB", random_weights=True)
    resident = registry.load(tmp_path / "bare")
    assert resident.report["random_init"]
    engine = Engine(registry, EngineLimits(compile=False))
    engine.start()
    try:
        answer = asyncio.run(engine.complete("bare", [5, 6, 7], GenerationParams(max_new_tokens=4, temperature=0)))
    finally:
        engine.close(timeout=30)
    assert answer.completion_tokens >= 1


def test_models_loaded_early_are_the_loads_the_api_asks_for_and_a_failed_one_fails_its_ask(model_root, monkeypatch):
    """`devmap serve`'s core loads its command line's models as its imports end (`load_early`); the API's later
    `load` of the same directory waits for that load (one load, not two), an early load that failed fails that ask
    with its own error, and a load with other arguments, or of a directory named again, is a load of its own."""
    from devmap.serving.core import EngineCore

    registry = ModelRegistry(model_root, "auto", "cpu=2GB")
    loads = []
    plain_load = registry.load
    monkeypatch.setattr(registry, "load", lambda path, *args: loads.append(path) or plain_load(path, *args))
    core = EngineCore(registry, EngineLimits(), lambda outputs: None)
    core.start()
    try:
        core.load_early([model_root / "tiny", str(model_root / "tiny"), model_root / "missing", model_root / "second"])
        described = core.load(str(model_root / "tiny"), under_root=False)
        assert described["id"] == "tiny" and described["plan"] and described["load_report"]
        with pytest.raises(ServiceError, match="missing"):  # its own error, as a load of it now would say
            core.load(str(model_root / "missing"), under_root=False)
        with pytest.raises(ServiceError, match="already loaded"):  # named twice: the second ask is a load of its own
            core.load(str(model_root / "tiny"), under_root=False)
        assert loads == [model_root / "tiny", model_root / "missing", model_root / "tiny"]  # "second": not started
        assert [resident.id for resident in registry.all()] == ["tiny"]
        second = core.load(str(model_root / "second"), model_id="other", under_root=False)  # after the failure: a
        assert second["id"] == "other"  # load of its own, asked for with other arguments
    finally:
        core.close(timeout=30)
