"""The API side of the engine, over a stand-in core: a step's outputs reach each event loop in one wake-up however
many steps it is behind, a slow reader gets what came as one chunk, a stop string ends the text and aborts the
request in the core, the queue's bound counts requests with no token yet, and a core that is gone ends every open
request with a 503."""

import asyncio
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from devmap.serving import Engine, EngineLimits, GenerationParams
from devmap.serving.core_client import ModelCard
from devmap.serving.errors import EngineGone, QueueFull
from devmap.serving.jobs import TokenOutput


class StandInCore:
    """Records what the API asks of it; the test plays the core's outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.added, self.aborted = tokenizer, [], []

    def attach(self, deliver, lost) -> None:
        self.deliver, self.lost = deliver, lost

    def start(self) -> None:
        pass

    def close(self, timeout=None) -> None:
        pass

    def add(self, job) -> None:
        self.added.append(job)

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)

    def card(self, model_id: str) -> ModelCard:
        return ModelCard(model_id, Path("."), 0, 0, self.tokenizer)

    def forget(self, model_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(model_root):
    return AutoTokenizer.from_pretrained(str(model_root / "tiny"), local_files_only=True)


def engine_over(tokenizer, **limits):
    core = StandInCore(tokenizer)
    return Engine(None, EngineLimits(**limits), core=core), core


def test_steps_an_event_loop_is_behind_on_arrive_in_one_wake_up_and_one_chunk(tokenizer):
    engine, core = engine_over(tokenizer)
    ids = tokenizer("the quick brown fox jumps", add_special_tokens=False)["input_ids"]

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        wakes = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), original(*a))[1]  # type: ignore[method-assign]
        job = engine.submit("m", [5, 6], GenerationParams(max_new_tokens=len(ids)))
        for k, token in enumerate(ids):  # one output per step, none applied yet: the loop has not run
            core.deliver([TokenOutput(job.id, [token], "length" if k == len(ids) - 1 else None)])
        chunks = [c async for c in engine.stream(job)]
        return chunks, job, len(wakes)

    chunks, job, wakes = asyncio.run(run())
    assert wakes == 1 and chunks == [tokenizer.decode(ids, skip_special_tokens=True)]
    assert job.finish_reason == "length" and job.generated == ids and not core.aborted


def test_a_stop_string_ends_the_text_and_aborts_the_request_in_the_core(tokenizer):
    engine, core = engine_over(tokenizer)
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)

    async def run() -> tuple:
        job = engine.submit("m", [5], GenerationParams(max_new_tokens=50, stop=("three",)))
        core.deliver([TokenOutput(job.id, ids)])
        text = "".join([c async for c in engine.stream(job)])
        return text, job

    text, job = asyncio.run(run())
    assert text == whole[:whole.find("three")] and job.finish_reason == "stop"
    assert core.aborted == [job.id]


def test_the_queue_counts_requests_with_no_token_yet(tokenizer):
    engine, core = engine_over(tokenizer, max_queue=2)

    async def run() -> None:
        first = engine.submit("m", [5], GenerationParams(max_new_tokens=4))
        engine.submit("m", [5], GenerationParams(max_new_tokens=4))
        with pytest.raises(QueueFull):
            engine.submit("m", [5], GenerationParams(max_new_tokens=4))
        core.deliver([TokenOutput(first.id, [7])])  # the first is in a batch now: room for one more
        await asyncio.sleep(0)
        engine.submit("m", [5], GenerationParams(max_new_tokens=4))

    asyncio.run(run())
    assert len(core.added) == 3


def test_a_core_that_is_gone_ends_every_open_request_with_503(tokenizer):
    engine, core = engine_over(tokenizer)

    async def run() -> EngineGone:
        job = engine.submit("m", [5], GenerationParams(max_new_tokens=4))
        core.lost(EngineGone("the engine core's process has ended (exit code -9); restart the service"))
        with pytest.raises(EngineGone) as gone:
            async for _ in engine.stream(job):
                pass
        return gone.value

    assert asyncio.run(run()).status == 503


class ThreadRecordingTokenizer:
    """The tokenizer, recording the threads that tokenize prompts and apply chat templates."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.threads = tokenizer, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.get_ident())
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(threading.get_ident())
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_prompts_are_tokenized_off_the_event_loop(tokenizer):
    """A megabyte of prompt takes a second to tokenize, in which no stream on the event loop would move."""
    import httpx

    from devmap.serving.app import create_app

    recording = ThreadRecordingTokenizer(tokenizer)
    engine, core = engine_over(recording)
    core.add = lambda job: core.deliver([TokenOutput(job.id, [7], "length")])  # one token, then done

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://devmap") as http:
            for path, body in (("/v1/completions", {"prompt": "the quick brown fox"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
                response = await http.post(path, json={"model": "m", "max_tokens": 1, **body})
                assert response.status_code == 200, response.text
        return [threading.get_ident()]

    loop_thread = asyncio.run(run())[0]
    assert len(recording.threads) == 3 and loop_thread not in recording.threads


def test_a_tokenizer_is_left_as_every_call_of_the_api_asks_before_threads_share_it(model_root, tmp_path):
    """A tokenizer.json with truncation and padding set: transformers would unset them on the shared Rust tokenizer
    at the first prompt, which fails ("Already borrowed") while another thread encodes or decodes; loading unsets
    them first."""
    import json
    import shutil

    from devmap.serving.prepare import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_root / "tiny" / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<unk>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.backend_tokenizer.truncation is None and tokenizer.backend_tokenizer.padding is None


def test_prompts_tokenized_in_many_threads_at_once_get_their_own_ids(model_root):
    """200 prompts at once, tokenized in worker threads while streams decode on the event loop: each request's ids
    are those of its prompt tokenized alone (a tokenizer as the service loads it)."""
    import httpx

    from devmap.serving.app import create_app
    from devmap.serving.prepare import load_tokenizer

    tokenizer = load_tokenizer(model_root / "tiny")
    engine, core = engine_over(tokenizer)
    prompts = [" ".join(["the quick brown fox", "jumps over", "a lazy dog"][: 1 + i % 3]) * (1 + i % 17)
               for i in range(200)]
    added = {}

    def add(job) -> None:
        added[job.id] = job.prompt_ids
        core.deliver([TokenOutput(job.id, [7, 8, 9], "length")])

    core.add = add

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://devmap", timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": 3, "stream": i % 2 == 0}) for i, p in enumerate(prompts)))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:2]
    expected = sorted(tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts)
    assert sorted(added.values()) == expected
