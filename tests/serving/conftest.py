"""A saved llama-tiny checkpoint (with the tokenizer `devmap save` writes) and real `devmap serve` processes."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import devmap

START_TIMEOUT = 90  # seconds for a fresh process to import torch, load llama-tiny and bind


@pytest.fixture(scope="package")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    devmap.save("llama-tiny", root / "tiny")
    devmap.save("llama-tiny", root / "second", seed=1)
    (root / "outside").mkdir()
    (root / "encoder").mkdir()  # a model the service does not generate with (not LLaMA-style)
    (root / "encoder" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(root: Path, *extra: str, max_memory: str | None = "cpu=2GB", env: dict | None = None):
    """`devmap serve ROOT/tiny --model-root ROOT ...` on a free port (within `max_memory`; None: the machine's; `env`:
    more environment variables); always stopped (SIGTERM, then kill)."""
    port = free_port()
    budget = ["--max-memory", max_memory] if max_memory else []
    command = [sys.executable, "-m", "devmap", "serve", str(root / "tiny"), "--model-root", str(root), *budget,
               "--port", str(port), "--log-level", "warning", *extra]
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"devmap serve exited with {process.returncode}: {process.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("devmap serve did not answer /health in time")
            time.sleep(0.1)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def server(model_root):
    with running_server(model_root, "--max-tokens", "64", "--max-prompt-tokens", "200") as (url, _):
        yield url


def spawned_children(pid: int) -> list[int]:
    """The children of process `pid` that multiprocessing spawned (Linux /proc): a server's engine core, a split
    engine core's shard processes."""
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def first_refusal(url: str, tries: int = 100) -> httpx.Response:
    """Completion requests until one is not answered 200 (a service noticing the loss of a process): that answer."""
    for _ in range(tries):
        answer = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                            timeout=30)
        if answer.status_code != 200:
            return answer
        time.sleep(0.1)
    return answer
