"""`devmap serve --tensor-parallel 2` on CPUs (two gloo processes, each holding half of every block): many requests at
once, some joining while others run, get the greedy answers of the whole model in one process, also for a model
loaded over HTTP; a shard process that ends makes every request and the health check answer 503 with the reason, and
leaves no process behind."""

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from transformers import AutoTokenizer

import devmap

from .conftest import first_refusal, running_server, spawned_children

SENTENCES = ["Hello", "The quick brown fox jumps", "devmap spreads one model", "A pipeline", "0 1 2 3 4 5 6 7"]


def whole_model_answers(root, model: str, device="cpu"):
    """devmap.generate of the whole model in this process (on `device`), greedy, cut at EOS, as text."""
    loaded = devmap.load(str(root / model), device, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(root / model), local_files_only=True)

    def answer(prompt: str, new: int) -> str:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tokens = devmap.generate(loaded, torch.tensor([ids]), max_new_tokens=new, eos_token_id=[2],
                                 pad_token_id=2)[0, len(ids):].tolist()
        return tokenizer.decode(tokens[:tokens.index(2)] if 2 in tokens else tokens, skip_special_tokens=True)

    return answer


def ask_together(url: str, model: str, requests: list[tuple[str, int]]) -> list[str]:
    async def ask(http: httpx.AsyncClient, prompt: str, new: int, delay: float) -> str:
        await asyncio.sleep(delay)  # the later half joins the running batch
        response = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": new,
                                                             "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def everyone() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(ask(http, p, n, 0.3 * (i >= len(requests) // 2))
                                          for i, (p, n) in enumerate(requests)))

    return asyncio.run(everyone())


@pytest.fixture(scope="module")
def mismatched(model_root):
    """A directory whose config's MLP is narrower than its weights (every process's load fails reading them)."""
    import json
    import shutil

    path = model_root / "mismatched"
    if not path.exists():
        shutil.copytree(model_root / "tiny", path)
        config = json.loads((path / "config.json").read_text())
        config["intermediate_size"] = 96
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the shard processes through /proc")
@pytest.mark.parametrize("joining", ["--no-ride", "--ride"])
def test_a_split_service_answers_as_the_whole_model_and_a_lost_shard_gives_503(model_root, mismatched, joining):
    requests = [(SENTENCES[i % len(SENTENCES)] + " " * (i // len(SENTENCES)), 4 + (5 * i) % 13) for i in range(12)]
    with running_server(model_root, "--tensor-parallel", "2", "--max-tokens", "32", joining) as (url, process):
        answers = ask_together(url, "tiny", requests)
        reference = whole_model_answers(model_root, "tiny")
        assert answers == [reference(p, n) for p, n in requests]
        loaded = httpx.post(url + "/v1/models/load", json={"model": "second"}, timeout=120)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["plan"]["tensor_parallel"]["size"] == 2
        second = whole_model_answers(model_root, "second")
        assert ask_together(url, "second", requests[:6]) == [second(p, n) for p, n in requests[:6]]
        assert httpx.delete(url + "/v1/models/second", timeout=60).status_code == 200
        placed = httpx.post(url + "/v1/models/load", json={"model": "second", "device_map": "balanced"}, timeout=60)
        assert placed.status_code == 400 and "leave device_map out" in placed.json()["error"]["message"]
        # weights that do not fit their config fail on every process: the load ends everywhere, the service goes on
        refused = httpx.post(url + "/v1/models/load", json={"model": "mismatched"}, timeout=120)
        assert refused.status_code in (400, 409) and "mismatched" in refused.json()["error"]["message"]
        assert ask_together(url, "tiny", requests[:3]) == answers[:3]

        shards = spawned_children(spawned_children(process.pid)[0])  # the engine core's children
        assert len(shards) == 1
        os.kill(shards[0], signal.SIGKILL)
        answer = first_refusal(url)
        assert answer.status_code == 503 and "shard process 1 of 2 ended" in answer.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and "restart the service" in health.json()["error"]["message"]
        assert process.poll() is None  # the API still answers
        assert not spawned_children(process.pid)  # the engine core and its shard are gone


# Loaded by every process of the server under test (PYTHONPATH): when devmap's continuous batches are imported, the
# `nth` step of the process of rank `rank` raises, as an out-of-memory error in one GPU's process would.
ONE_PROCESS_FAULT = '''
import importlib.abc
import importlib.util
import os
import sys

RANK, NTH = (int(part) for part in os.environ["DEVMAP_TEST_FAULT"].split(":"))


def fault(batches):
    step, calls = batches.ContinuousBatch._step, [0]

    def failing(self, *args, **kwargs):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == RANK:
            calls[0] += 1
            if calls[0] == NTH:
                raise RuntimeError("out of memory (a test's fault)")
        return step(self, *args, **kwargs)

    batches.ContinuousBatch._step = failing


class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "devmap.generation.continuous":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            fault(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hook())
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the shard processes through /proc")
@pytest.mark.parametrize("rank", [1, 0], ids=["in a shard process", "on rank 0"])
def test_a_step_failing_in_one_process_ends_the_split_with_its_reason(model_root, tmp_path, rank):
    # going on, the processes would disagree on which all-reduce comes next: a hang, or one step's sums in another's
    (tmp_path / "sitecustomize.py").write_text(ONE_PROCESS_FAULT)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "DEVMAP_TEST_FAULT": f"{rank}:3"}
    with running_server(model_root, "--tensor-parallel", "2", "--max-tokens", "32", env=env) as (url, process):
        answer = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                            "temperature": 0}, timeout=120)
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        where = "shard process 1 of 2 ended (exit code 1) (its step call failed" if rank else "a step failed on rank 0"
        assert where in message and "RuntimeError: out of memory (a test's fault)" in message
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and "restart the service" in health.json()["error"]["message"]
        assert process.poll() is None  # the API still answers
        deadline = time.monotonic() + 30
        while spawned_children(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not spawned_children(process.pid)  # the engine core and its shard are gone
