"""A real `devmap serve` process under requests a hostile or careless client sends: values that would reach a tensor
out of range, OpenAI options devmap does not implement, and an unload while clients keep coming. None of them may
fail another request; each gets a 4xx naming what was wrong. And the OpenAI scoring options devmap does implement
(`logprobs`, `top_logprobs`, `echo`) against transformers' own logits."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import devmap

from .conftest import running_server

BAD_VALUES = [
    ({"prompt": [5, 512, 7]}, "prompt", "vocabulary"),  # llama-tiny's vocabulary is 512 tokens
    ({"prompt": [-1, 5]}, "prompt", "vocabulary"),
    ({"prompt": [5, 2 ** 70]}, "prompt", "vocabulary"),
    ({"prompt": [[5, 600]]}, "prompt", "vocabulary"),
    ({"prompt": "Hello", "seed": 2 ** 64}, "seed", "seed"),
    ({"prompt": "Hello", "seed": 10 ** 23}, "seed", "seed"),
    ({"prompt": "Hello", "logprobs": 21}, "logprobs", "logprobs"),
]


@pytest.fixture(scope="module")
def hostile_server(model_root):
    with running_server(model_root, "--max-tokens", "200", "--max-prompt-tokens", "64",
                        "--unload-drain", "1") as (url, _):
        yield url


@pytest.fixture(scope="module")
def tiny(model_root):
    """transformers' own model of the checkpoint (float32), its tokenizer, and devmap's greedy text per prompt."""
    model = AutoModelForCausalLM.from_pretrained(str(model_root / "tiny"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_root / "tiny"), local_files_only=True)
    placed = devmap.load(str(model_root / "tiny"), "auto", "cpu=1GB")

    def greedy(ids: list[int], new: int) -> str:
        out = devmap.generate(placed, torch.tensor([ids]), max_new_tokens=new, eos_token_id=[2], pad_token_id=2)
        tokens = out[0, len(ids):].tolist()
        return tokenizer.decode(tokens[:tokens.index(2)] if 2 in tokens else tokens, skip_special_tokens=True)

    return model, tokenizer, greedy


def test_values_out_of_range_get_400_naming_the_field_and_their_neighbours_are_untouched(hostile_server, tiny):
    """Bad ids and seeds sent while ordinary streaming requests run: each gets 400 naming its field, and the ordinary
    requests get the greedy text of devmap.generate."""
    _, tokenizer, greedy = tiny
    prompts = [[5 + 13 * i % 300, 6, 7, 8 + i] for i in range(6)]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=hostile_server, timeout=120) as http:
            async def ordinary(ids: list[int]) -> str:
                text = ""
                async with http.stream("POST", "/v1/completions", json={
                        "model": "tiny", "prompt": ids, "max_tokens": 60, "temperature": 0, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = httpx.Response(200, content=line[6:]).json()
                            assert "error" not in chunk, chunk
                            text += chunk["choices"][0]["text"]
                return text

            async def bad(extra: dict) -> httpx.Response:
                await asyncio.sleep(0.05)
                return await http.post("/v1/completions", json={"model": "tiny", "max_tokens": 5, **extra})

            good = [asyncio.ensure_future(ordinary(p)) for p in prompts]
            refused = await asyncio.gather(*(bad(extra) for extra, _, _ in BAD_VALUES))
            return await asyncio.gather(*good), refused

    texts, refused = asyncio.run(run())
    for response, (extra, field, words) in zip(refused, BAD_VALUES):
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == field and words in error["message"], (extra, error)
    assert texts == [greedy(p, 60) for p in prompts]


@pytest.mark.parametrize("extra, option", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 100}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
])
def test_chat_options_devmap_does_not_implement_are_refused_by_name(hostile_server, extra, option):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}
    response = httpx.post(hostile_server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert option in response.json()["error"]["message"]


@pytest.mark.parametrize("extra, option", [({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
                                           ({"presence_penalty": 1.0}, "presence_penalty")])
def test_completion_options_devmap_does_not_implement_are_refused_by_name(hostile_server, extra, option):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, **extra}
    response = httpx.post(hostile_server + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert option in response.json()["error"]["message"]


@pytest.mark.parametrize("path, body, field, lone, whole", [
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi TEXT", "max_tokens": 3}', "prompt", "\\ud800", 200),
    ("/v1/completions", '{"model": "tiny", "prompt": ["TEXT"], "max_tokens": 3}', "prompt.0", "\\udfff", 200),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "stop": ["a", "TEXT"], "max_tokens": 3}', "stop.1",
     "\\ud83d", 200),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 3, "TEXT": 0}', "a field name in the body",
     "\\ud800", 400),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "TEXT"}], "max_tokens": 3}',
     "messages.0.content", "\\ud800", 200),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "a TEXT"}]}], "max_tokens": 3}', "messages.0.content.0.text", "\\udc00", 200),
    ("/v1/chat/completions", '{"model": "TEXT", "messages": [{"role": "user", "content": "Hi"}]}', "model",
     "\\ud800", 404),
    ("/v1/models/load", '{"model": "TEXT"}', "model", "\\ud800", 404),
])
def test_text_that_is_not_unicode_gets_400_naming_the_field(hostile_server, path, body, field, lone, whole):
    """JSON can spell a lone surrogate, which is no character and which no tokenizer reads (it answered 500): 400
    naming its place, wherever it is; a surrogate pair (an emoji) in the same place is text as any other."""
    def post(text: str) -> httpx.Response:
        return httpx.post(hostile_server + path, content=body.replace("TEXT", text).encode(), timeout=60,
                          headers={"content-type": "application/json"})

    response = post(lone)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "lone surrogate" in error["message"], error
    response = post("\\ud83d\\ude00")
    assert response.status_code == whole and "lone surrogate" not in response.text, response.text


@pytest.mark.parametrize("body, content_type, words", [
    (b"not json", "application/json", "not valid JSON (Expecting value at character 0)"),
    (b'{"model": "tiny",', "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
    (b'{"model": "tiny", "prompt": "Hi"}', "text/plain", "content-type: application/json"),
])
def test_a_body_that_is_no_json_object_gets_400_saying_so(hostile_server, body, content_type, words):
    response = httpx.post(hostile_server + "/v1/completions", content=body, headers={"content-type": content_type},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] is None, error


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stop", "seed", "logprobs", "top_logprobs", "echo", "user", "stream_options", "logit_bias", "tools",
          "response_format", "frequency_penalty", "suffix", "best_of"]
TEXTS = st.one_of(st.text(max_size=30), st.sampled_from(["\ud800", "a\udc00b", "", "\x00", "\U0001f642", "</s>"]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 300),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), TEXTS)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXTS, inner, max_size=3)), max_leaves=8)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), TEXTS),
    "content": st.one_of(TEXTS, VALUES, st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["text", "image_url"]), "text": TEXTS}), max_size=2))}), max_size=3)


def test_no_body_gets_a_server_error(hostile_server):
    """Valid bodies with up to three fields set to anything JSON can hold (NaN and lone surrogates too, unknown
    fields, wrong types, nested values): each gets 200 with no error in its stream, or a 4xx with an error message."""

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           st.dictionaries(st.one_of(st.sampled_from(FIELDS), TEXTS), VALUES, max_size=3),
           st.one_of(st.none(), MESSAGES), st.booleans())
    def check(path, changes, messages, stream):
        body = {"model": "tiny", "max_tokens": 2, "stream": stream}
        if path == "/v1/completions":
            body["prompt"] = "Hello"
        else:
            body["messages"] = messages if messages is not None else [{"role": "user", "content": "Hi"}]
        body.update(changes)
        with httpx.stream("POST", hostile_server + path, content=json.dumps(body, allow_nan=True).encode(),
                          headers={"content-type": "application/json"}, timeout=60) as response:
            data = response.read().decode()
        assert response.status_code < 500, (body, data[:300])
        if response.status_code >= 400:
            assert json.loads(data)["error"]["message"], data
        for line in data.splitlines():
            assert not line.startswith("data: {") or "error" not in json.loads(line[6:]), (body, line)

    check()


def test_neutral_values_and_options_that_change_nothing_are_accepted(hostile_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 3, "frequency_penalty": 0, "presence_penalty": 0.0, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "user": "someone", "stream_options": None, "logit_bias": {}}
    response = httpx.post(hostile_server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the logits at every position of `ids` (len × vocab)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_chat_logprobs_and_top_logprobs_are_those_of_transformers_logits(hostile_server, tiny):
    model, tokenizer, _ = tiny
    api = openai.OpenAI(base_url=hostile_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    done = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    prompt = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    generated = tokenizer(done.choices[0].message.content, add_special_tokens=False)["input_ids"]
    reference = reference_logprobs(model, prompt + generated)
    for i, entry in enumerate(content[:len(generated)]):
        row = reference[len(prompt) - 1 + i]
        best = row.topk(3)
        assert abs(entry.logprob - best.values[0].item()) < 1e-3  # greedy: the chosen token is the likeliest
        assert [abs(t.logprob - v) < 1e-3 for t, v in zip(entry.top_logprobs, best.values.tolist())] == [True] * 3
    streamed = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3, stream=True)
    chunks = [c.choices[0].logprobs.content for c in streamed if c.choices and c.choices[0].logprobs]
    flat = [entry for chunk in chunks for entry in chunk or []]
    assert [(e.token, round(e.logprob, 5)) for e in flat] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_with_echo_score_the_prompt_as_lm_eval_reads_them(hostile_server, tiny):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1, temperature 0; it
    sums token_logprobs[ctxlen:-1] and checks each against max(top_logprobs)."""
    model, _, _ = tiny
    ids = [1, 15, 27, 9, 88, 140, 7]
    api = openai.OpenAI(base_url=hostile_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    choice = api.completions.create(model="tiny", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                                    seed=1234).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    reference = reference_logprobs(model, ids)
    for i in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[i] - reference[i - 1, ids[i]].item()) < 1e-3
        assert abs(max(logprobs.top_logprobs[i].values()) - reference[i - 1].max().item()) < 1e-3
    assert abs(logprobs.token_logprobs[-1] - reference[-1].max().item()) < 1e-3  # the greedy new token
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert choice.text.startswith("".join(logprobs.tokens[:len(ids)]))
    streamed = api.completions.create(model="tiny", prompt=[ids], echo=True, logprobs=1, max_tokens=4,
                                      temperature=0, stream=True)
    scores = [v for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for v in chunk.choices[0].logprobs.token_logprobs]
    assert scores[0] is None and len(scores) >= len(ids)
    assert [round(v, 5) for v in scores[1:len(ids)]] == [round(v, 5) for v in logprobs.token_logprobs[1:len(ids)]]


def test_an_unload_answers_within_its_drain_bound_while_clients_keep_coming(hostile_server):
    """Six clients asking the model back to back: DELETE answers within --unload-drain (1 s) and a step, new
    requests get 503 (then 404 once it is gone), and no client sees a 500."""
    with httpx.Client(base_url=hostile_server, timeout=60) as http:
        assert http.post("/v1/models/load", json={"model": "second", "id": "busy"}).status_code == 200
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=hostile_server, timeout=60) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"model": "busy", "prompt": "Hello", "max_tokens": 200,
                                                       "temperature": 0})
                statuses.append(r.status_code)
                if r.status_code != 200:
                    return

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    began = time.monotonic()
    gone = httpx.delete(hostile_server + "/v1/models/busy", timeout=60)
    took = time.monotonic() - began
    stop.set()
    for thread in threads:
        thread.join(60)
    assert gone.status_code == 200 and took < 1 + 10, took  # the bound, and a step on a loaded machine
    assert statuses and set(statuses) <= {200, 503, 404} and 500 not in statuses
