"""A real `devmap serve` process on 127.0.0.1, driven by the openai client and httpx."""

import asyncio
import signal
import sys
import time

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

import devmap
from devmap.cli import main

from .conftest import first_refusal, running_server, spawned_children


@pytest.fixture(scope="module")
def reference(model_root):
    """What devmap.generate answers in this process for one prompt (greedy, cut at EOS)."""
    model = devmap.load(str(model_root / "tiny"), "auto", "cpu=1GB")
    tokenizer = AutoTokenizer.from_pretrained(str(model_root / "tiny"), local_files_only=True)

    def answer(ids: list[int], new: int) -> str:
        out = devmap.generate(model, torch.tensor([ids]), max_new_tokens=new, eos_token_id=[2], pad_token_id=2)
        tokens = out[0, len(ids):].tolist()
        tokens = tokens[:tokens.index(2)] if 2 in tokens else tokens
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_ids(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    answer.tokenizer, answer.chat_ids = tokenizer, chat_ids
    return answer


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_completion_and_chat_equal_devmap_generate(server, reference):
    api = client(server)
    prompt = "The quick brown fox"
    ids = reference.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    done = api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text == reference(ids, 8)
    assert done.usage.prompt_tokens == len(ids) and done.choices[0].finish_reason in ("length", "stop")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you?"}]
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == reference(reference.chat_ids(messages), 6)
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in api.models.list().data] == ["tiny"]


def test_streaming_gives_the_same_text(server):
    api = client(server)
    whole = api.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    pieces = list(api.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")
    messages = [{"role": "user", "content": "what is the capital of France?"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=7, temperature=0)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=7, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_twenty_concurrent_clients_are_batched_and_answered_like_generate(server, reference):
    sentences = ["Hello", "The quick brown fox jumps", "devmap spreads one model", "A pipeline",
                 "Paris is the capital of", "0 1 2 3 4 5 6 7"]
    prompts = [sentences[i % len(sentences)] + " " * (i // len(sentences)) for i in range(20)]

    async def ask(http: httpx.AsyncClient, prompt: str) -> str:
        response = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                             "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def everyone() -> list[str]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            return await asyncio.gather(*(ask(http, p) for p in prompts))

    answers = asyncio.run(everyone())
    for prompt, answer in zip(prompts, answers):
        assert answer == reference(reference.tokenizer(prompt, add_special_tokens=False)["input_ids"], 8)
    metrics = httpx.get(server + "/metrics").text
    def metric(name: str) -> float:
        return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name)))

    # requests shared batches: they started together, or joined a running one (continuous batching)
    assert metric("devmap_batch_size_sum") + metric("devmap_joined_requests_total") > metric("devmap_batch_size_count")
    assert "devmap_request_seconds_bucket" in metrics and "devmap_queue_depth" in metrics


def test_load_and_unload_a_second_model(server, model_root):
    with httpx.Client(base_url=server, timeout=60) as http:
        loaded = http.post("/v1/models/load", json={"model": "second", "device_map": "auto"})
        assert loaded.status_code == 200, loaded.text
        body = loaded.json()
        assert body["id"] == "second" and body["plan"]["device_map"] and body["load_report"]["devices"]
        # where the load went (on a CPU its steps do not compile: no compile, capture or warm-up phase)
        assert list(body["load_seconds"]) == ["plan", "weights", "prepare"] and body["compiled_graphs"] is None
        assert all(seconds >= 0 for seconds in body["load_seconds"].values())
        shown = http.get("/metrics").text
        assert 'devmap_model_load_seconds{model="second",phase="weights"}' in shown
        assert 'devmap_startup_seconds{phase="core_process"}' in shown  # the engine core's process start
        assert 'devmap_startup_seconds{phase="command_line_loads"}' in shown  # the models devmap serve was given
        if sys.platform.startswith("linux"):  # devmap serve's own imports, and its start until it answered: /proc
            assert 'devmap_startup_seconds{phase="api_imports"}' in shown
            ready = next(line for line in shown.splitlines() if line.startswith("devmap_serve_ready_seconds "))
            assert float(ready.split()[-1]) > 0
        assert sorted(m["id"] for m in http.get("/v1/models").json()["data"]) == ["second", "tiny"]
        answer = http.post("/v1/completions", json={"model": "second", "prompt": "Hello", "max_tokens": 3})
        assert answer.status_code == 200
        assert http.post("/v1/models/load", json={"model": "second"}).status_code == 400  # already loaded
        assert http.delete("/v1/models/second").json()["deleted"] is True
        assert 'devmap_model_load_seconds{model="second"' not in http.get("/metrics").text
        gone = http.post("/v1/completions", json={"model": "second", "prompt": "Hello"})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
        assert http.delete("/v1/models/second").status_code == 404
        for name, status in (("../outside", 400), ("/etc", 400), ("missing", 404), ("outside", 400)):
            refused = http.post("/v1/models/load", json={"model": name})
            assert refused.status_code == status, (name, refused.text)
            assert refused.json()["error"]["message"]
        encoder = http.post("/v1/models/load", json={"model": "encoder"})
        assert encoder.status_code == 400 and "'bert' model" in encoder.json()["error"]["message"], encoder.text
        too_big = http.post("/v1/models/load", json={"model": "second", "max_memory": "cpu=10KB"})
        assert too_big.status_code == 409 and "does not fit" in too_big.json()["error"]["message"]


@pytest.mark.parametrize("body, status, words", [
    (b"{bad json", 400, "JSON"),
    ({"model": "nope", "prompt": "x"}, 404, "not loaded"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "word " * 300}, 400, "at most 200"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n: Input should be less than or equal to 1"),
    ({"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
    ({"prompt": "x"}, 400, "model: Field required"),
])
def test_bad_requests_get_openai_errors(server, body, status, words):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server + "/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"]
    unknown = httpx.get(server + "/v1/nothing-here")
    assert unknown.status_code == 404 and "no route" in unknown.json()["error"]["message"]


def test_api_key_and_graceful_shutdown(model_root):
    with running_server(model_root, "--api-key", "sesame") as (url, process):
        assert httpx.get(url + "/health").status_code == 200  # liveness stays open
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        api = client(url, "sesame")
        stream = api.completions.create(model="tiny", prompt="Hello", max_tokens=60, temperature=0, stream=True)
        pieces = [next(iter(stream))]
        process.send_signal(signal.SIGTERM)  # in flight: the request still completes
        pieces += list(stream)
        assert pieces[-1].choices[0].finish_reason in ("length", "stop")
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained


def test_cli_refuses_an_open_bind_without_a_key(model_root):
    result = CliRunner().invoke(main, ["serve", str(model_root / "tiny"), "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "--api-key" in result.output
    result = CliRunner().invoke(main, ["serve"])
    assert result.exit_code == 2 and "nothing to serve" in result.output
    result = CliRunner().invoke(main, ["serve", str(model_root / "tiny"), "--compile-beside", "--no-compile"])
    assert result.exit_code == 2 and "--compile-beside" in result.output


def test_a_request_that_ends_early_is_counted(server):
    started = time.perf_counter()
    response = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                              "temperature": 0, "stop": ["\n"]}, timeout=30)
    assert response.status_code == 200 and time.perf_counter() - started < 30
    assert response.json()["usage"]["completion_tokens"] <= 2


def test_a_ten_megabyte_prompt_is_refused_before_it_is_read_or_tokenized(server):
    """413 from the declared length, at once; a body sent without a length is cut off as it passes the limit."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"word " * 2_000_000 + b'"}]}'
    refused = httpx.post(server + "/v1/chat/completions", content=body, timeout=30,
                         headers={"content-type": "application/json"})
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert "--max-prompt-tokens" in error["message"] and error["type"] == "invalid_request_error"
    # refused from its declared length (the exact size, not "more than" a count of bytes read so far)
    assert error["message"].startswith(f"the request body is {len(body):,} bytes")

    def chunks():
        for k in range(0, len(body), 1 << 16):
            yield body[k:k + (1 << 16)]

    streamed = httpx.post(server + "/v1/chat/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "more than" in streamed.json()["error"]["message"]
    assert httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                      timeout=30).status_code == 200  # the service goes on


def test_more_than_four_stop_strings_are_refused_as_openai_does(server):
    response = httpx.post(server + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "x", "stop": [f"s{k}" for k in range(5)]})
    assert response.status_code == 400 and "at most 4 stop sequences" in response.json()["error"]["message"]
    four = httpx.post(server + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c", "d"]})
    assert four.status_code == 200


def test_the_engine_core_runs_in_its_own_process_and_its_death_gives_503_not_a_hang(model_root):
    """The models and the batching loop live in a spawned process; if it dies (killed, out of memory), open
    requests and every later one get 503 at once, and the health check says so."""
    import os

    with running_server(model_root) as (url, process):
        core = spawned_children(process.pid)[0]
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                          timeout=30).status_code == 200
        os.kill(core, signal.SIGKILL)
        answer = first_refusal(url)  # the API notices the pipe close at once
        assert answer.status_code == 503 and "engine core" in answer.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        assert process.poll() is None  # the API itself still answers


def test_profile_endpoints_record_the_engine_cores_steps(server, model_root, tmp_path):
    """Without --profile-dir they answer 404 saying how to turn them on; with it, a profile around a request writes
    a Chrome trace and an op table of the core's steps; a second stop, or a start while recording, is a 400."""
    off = httpx.post(server + "/start_profile", timeout=30)
    assert off.status_code == 404 and "--profile-dir" in off.json()["error"]["message"]
    with running_server(model_root, "--profile-dir", str(tmp_path / "traces")) as (url, _):
        assert httpx.post(url + "/stop_profile", timeout=30).status_code == 400
        assert httpx.post(url + "/start_profile", timeout=60).json()["profiling"] is True
        assert httpx.post(url + "/start_profile", timeout=60).status_code == 400
        answer = client(url).completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert answer.choices[0].text is not None
        written = httpx.post(url + "/stop_profile", timeout=120).json()
        assert written["profiling"] is False
        assert '"traceEvents"' in open(written["trace"]).read(4096)
        assert "aten::" in open(written["ops"]).read()
