"""Serving: N concurrent streaming clients against `devmap serve` and `transformers serve`, same model, same run.

Run on nvidia-h200-x2 (the wheels of fastapi, uvicorn, pydantic and openai travel with the command):
    PYTHONPATH=. python3 benchmarks/serve.py --model tinyllama-1.1b --clients 1,8,32,64 --out $OUT
The checkpoint is `devmap save MODEL` (random bf16 weights and devmap's offline tokenizer), written once to
a temporary directory; with `--load-format dummy` only its configs and tokenizer are written and devmap serves random
weights made on the GPUs (`devmap serve --load-format dummy`): a 70B model's 138 GB need neither the disk nor the
minutes of writing them. Each server runs as its own process on 127.0.0.1; each client sends streaming chat
completions of mixed prompt lengths (greedy, `max_tokens` new tokens) back to back for `--seconds`; the clients
are spread over `--client-processes` processes (one process's event loop delays its own clocks at thousands of
streamed chunks a second).
Reported per server and client count: output tokens/s (all clients), time to first token p50/p99,
time per output token p50/p99 (a request's time from its first text to its
last, over its output tokens after the first), the floor and the share of the step it is, and devmap's ratio to
transformers. The floor is the larger of two: a decode step of that load reading the weights and the running
requests' KV cache once at the HBM bandwidth measured on this GPU in the same run ("reads"), and its arithmetic at
the bf16 rate measured the same way: every running request's token and the prompt tokens each round takes in beside
them (the load's prompt tokens per output token), 2 operations per parameter ("FLOPs").
`--systems devmap+int8` (+int4, +nf4, +fp8; +compile, +no-compile, +beside, +first; +ride, +no-ride) serves devmap with
those flags, its floor reading the quantized weights; `devmap+tp` serves each `--gpus` row with `--tensor-parallel`
over its GPUs (instead of `--devmap-args`' --device-map and --lanes), its floor each GPU reading 1/N of the weights and
KV cache; `devmap@DIR` serves devmap's sources in DIR (an earlier release, as a baseline in the same run).
`--gpus 1,2,4` serves each devmap system on the machine's first 1, 2 and 4 GPUs in turn (CUDA_VISIBLE_DEVICES, the
same checkpoint), rows named `SYSTEM/NgpuS`, each with its ratio to the same system on one GPU at the same client count;
such a row's floor knows the pipeline: per round every stage reads its weights once per lane and its lanes' KV cache,
and each lane goes through the stages one after the other, so a round of S stages and L lanes holding requests takes at
least max(L × W / S + KV / S, W + KV / L) / bandwidth for weights W and the running requests' cache KV (L: the lanes
holding requests, as many as the clients up to S unless `--devmap-args` sets `--lanes`), and its arithmetic spreads
over min(L, S) GPUs.
Each server's cold start (a fresh process until it answers) is printed; `--restart` starts each server once more
after its runs, for a restart's time with the compile caches on disk that its first start filled, and the first
window of the first client count once its compiled steps serve (its new batch shape's captures; transformers serve's
compile at its first requests). A devmap server that compiles beside its serving (`+beside`: --compile-beside; by
default where nothing of the model is stored, `+first`: --compile-first never) answers on eager steps while its steps
compile: from its
first answer until its compiled steps serve it gets windows of the first client count (their TTFT and tok/s printed:
the swap's cost), and the timed rows start after; a restart gets the same windows.
transformers serve runs with its best flags (`--continuous-batching --compile --device cuda:0`); flags its release does
not know are dropped one at a time, and the flags used are printed. `transformers+int8` (+int4, +nf4, +fp8) serves a
pre-quantized copy of the preset's checkpoint (`devmap save MODEL --quantize`, the same seed: torchao's or bitsandbytes'
layout, which transformers loads itself), its floor reading the quantized weights; a devmap row of a scheme is compared
with the transformers row of the same scheme where there is one.
`--cpu-check` runs devmap's rows on the CPU (a split over gloo processes) with placeholder floors: a check that the
script runs end to end (tests/test_benchmarks.py runs it), not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty
from typing import Any, Iterator

import httpx

WORDS = ("the quick brown fox jumps over the lazy dog devmap spreads one model over the GPUs of a machine and "
         "makes them work together a pipeline splits the batch into micro batches").split()


def label(system: str) -> str:
    """A system's name as part of a file name."""
    return system.replace("/", "_").replace("@", "-").replace("+", "-")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(command: list[str], port: int, name: str, timeout: float = 600, env: dict[str, str] | None = None,
           cwd: str | None = None, processes: list[Any] | None = None) -> Iterator[tuple[str, float]]:
    """Start a server process and wait for it to answer; yields its URL and the seconds until it answered (the
    cold start); always stopped after. `processes`, when given, gets the process."""
    log = open(Path(os.environ.get("SERVE_BENCH_LOGS", tempfile.gettempdir())) / f"serve-bench-{label(name)}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if processes is not None:
        processes.append(process)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.flush()
                last = Path(log.name).read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{name} exited with {process.returncode}; the end of {log.name}:\n"
                                   + "\n".join(last))
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2)  # any answer: it listens (transformers' /v1/models
                break                                   # needs a hub cache directory)
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name} did not answer in {timeout} s; see {log.name}")
        cold = time.monotonic() - started
        print(f"  {name} answers {cold:.1f} s after its process started", flush=True)
        yield url, cold
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def compiling(url: str) -> bool:
    """Whether any model of a devmap server is still compiling its steps beside its serving."""
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return any(m.get("compiling") for m in models)


def while_compiling(url: str, model: str, clients: int, seconds: float, new: int, lengths: list[int],
                    timeout: float = 900, profile: float = 0.0) -> tuple[list[dict[str, Any]], float]:
    """Timed windows of `clients` clients from the server's first answer until its compiled steps serve (the
    window in which they take over included), and the seconds until then; the first window's start profiled for
    `profile` seconds where asked (`profiled`)."""
    started, windows = time.monotonic(), []
    while compiling(url) and time.monotonic() - started < timeout:
        with profiled(url, profile if not windows else 0.0) as timed:
            windows.append(load_test(url, model, clients, seconds, new, seed=len(windows), lengths=lengths,
                                     timed=timed))
    return windows, time.monotonic() - started + wait_compiled(url, timeout)


@contextlib.contextmanager
def profiled(url: str, seconds: float) -> Iterator[Any]:
    """A `timed` callback for `load_test` that profiles the engine core for `seconds` from the timed window's start
    (`profile_later`; None for 0 seconds), waited for on the way out."""
    if not seconds:
        yield None
        return
    threads: list[threading.Thread] = []
    yield lambda: threads.append(profile_later(url, seconds))
    for thread in threads:
        thread.join()


def compiling_line(ready: float, windows: list[dict[str, Any]], clients: int) -> str:
    """When a server's compiled steps served, and how its clients fared in the windows before."""
    line = f"compiled steps serve {ready:.1f} s after its process started; {len(windows)} windows of {clients} clients"
    if not windows:
        return line + " before that"
    worst = max(w["ttft_p99"] or 0.0 for w in windows)
    each = ", ".join(f"{w['ttft_p99'] or 0.0:.2f}" for w in windows)
    rates = ", ".join(f"{w['tokens_per_s']:,.0f}" for w in windows)
    return line + f" before that, TTFT p99 at most {worst:.2f} s (each window: {each} s; {rates} tok/s)"


def start_phases(url: str) -> dict[str, Any]:
    """Where a devmap server's start went, as it says: its phases (`devmap_startup_seconds`: the engine core's process,
    its own imports, its command line's loads) and each model's load phases and compiled graphs (`/v1/models`)."""
    metrics = httpx.get(url + "/metrics", timeout=30).text
    startup = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith('devmap_startup_seconds{phase="')}
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {"startup_s": startup, "loads": {m["id"]: {"load_seconds": m.get("load_seconds"),
                                                      "compiled_graphs": m.get("compiled_graphs")} for m in models}}


def phases_line(phases: dict[str, Any]) -> str:
    """"core_process 9.1 s, api_imports 6.0 s, ...; tiny: plan 0.4 s, ..., compile 9.5 s (5 graphs, 5 from the
    cache), ..." for the console."""
    parts = [", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in phases["startup_s"].items())]
    for model, load in phases["loads"].items():
        graphs = load.get("compiled_graphs")
        parts.append(f"{model}: " + ", ".join(
            f"{phase} {seconds:.1f} s" + (f" ({graphs['total']} graphs, {graphs['from_cache']} from the cache)"
                                          if phase == "compile" and graphs else "")
            for phase, seconds in (load.get("load_seconds") or {}).items()))
    return "; ".join(part for part in parts if part)


def wait_compiled(url: str, timeout: float = 900) -> float:
    """Seconds until no model of a devmap server is compiling beside its serving."""
    started = time.monotonic()
    while compiling(url) and time.monotonic() - started < timeout:
        time.sleep(0.5)
    return time.monotonic() - started


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, new: int) -> dict[str, Any]:
    """One streaming chat completion: time to its first piece of text, its output tokens (the final chunk's
    usage, else the number of text pieces), its time per output token after the first, its longest pause between two
    pieces of text, and when it was sent and ended (time.monotonic)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, start = time.monotonic(), time.perf_counter()
    times: list[float] = []
    tokens = prompt_tokens = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            choices = chunk.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    tokens = len(times) if tokens is None else tokens
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return {"ttft": times[0] - start if times else None, "tokens": tokens, "tpot": tpot, "prompt_tokens": prompt_tokens,
            "gap": max((b - a for a, b in zip(times, times[1:])), default=None), "sent": sent,
            "ended": time.monotonic()}


async def _window(url: str, model: str, clients: int, seconds: float, new: int, rng: random.Random,
                  lengths: list[int], into: list[dict[str, Any]]) -> None:
    """`clients` clients sending requests back to back until `seconds` have passed (each ends its last one)."""
    stop_at = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            words = rng.choice(lengths)  # mixed prompt lengths
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            into.append(await one_request(http, model, prompt, new))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))


def _client_process(url: str, model: str, clients: int, seconds: float, new: int, seed: int, lengths: list[int],
                    warmup: float, barrier: Any, results: Any) -> None:
    """One client process: the warm-up window, then (once every process, and the parent, is through it) the timed
    window."""
    rng = random.Random(seed)
    barrier.wait()
    try:
        if warmup > 0:
            asyncio.run(_window(url, model, clients, warmup, new, rng, lengths, []))
    except BaseException:
        barrier.abort()  # the parent and the other processes stop waiting for this one
        raise
    barrier.wait()  # the timed window starts for every process once every warm-up request has ended
    start, into = time.monotonic(), []
    asyncio.run(_window(url, model, clients, seconds, new, rng, lengths, into))
    results.put((start, time.monotonic(), into))


def load_test(url: str, model: str, clients: int, seconds: float, new: int, seed: int, lengths: list[int],
              warmup: float = 0.0, processes: int = 1, timed: Any = None) -> dict[str, Any]:
    """One request alone (the first call: compilation, graphs), then `clients` clients for `warmup` seconds
    (untimed: the servers' first batches of this load capture or compile their shapes), then for `seconds`.
    The clients are spread over `processes` processes, so that reading thousands of streamed chunks a second
    does not delay the clients' own clocks (one Python event loop per process). `timed()` is called as the timed
    window starts (after the warm-up)."""
    async def first() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            start = time.monotonic()
            await one_request(http, model, "warm up " * 8, new)  # first call: compilation, graphs
            return time.monotonic() - start

    first_call = asyncio.run(first())
    processes = max(1, min(processes, clients))
    context = multiprocessing.get_context("fork")  # this process holds no GPU context and runs no thread now
    barrier, queue = context.Barrier(processes + 1), context.Queue()  # the parent waits with them
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    workers = [context.Process(target=_client_process, args=(url, model, share, seconds, new, seed * 1000 + i,
                                                             lengths, warmup, barrier, queue))
               for i, share in enumerate(shares)]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(timeout=300)  # they start the warm-up
        barrier.wait(timeout=warmup + 900)  # every warm-up request has ended: the timed window starts
    except threading.BrokenBarrierError:
        for worker in workers:
            worker.kill()
        raise RuntimeError("the client processes did not get through their warm-up (a failed one's traceback is "
                           "above)") from None
    if timed is not None:
        timed()
    parts: list[tuple[float, float, list[dict[str, Any]]]] = []
    while len(parts) < len(workers):
        try:
            parts.append(queue.get(timeout=1.0))
        except Empty:
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed:  # its traceback is above; the others would wait at the barrier forever
                for worker in workers:
                    worker.kill()
                raise RuntimeError(f"a client process failed (exit code {failed[0]})") from None
    for worker in workers:
        worker.join()
    results = [r for _, _, into in parts for r in into]
    elapsed = max(end for _, end, _ in parts) - min(start for start, _, _ in parts)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tpots = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    prompts = [r["prompt_tokens"] for r in results if r["prompt_tokens"] is not None]
    return {"clients": clients, "requests": len(results), "seconds": elapsed, "first_call_s": first_call,
            "mean_prompt_tokens": statistics.mean(prompts) if prompts else None,
            "mean_new_tokens": statistics.mean(r["tokens"] for r in results) if results else None,
            "client_processes": processes, "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
            "ttft_p50": _quantile(ttfts, 0.5), "ttft_p99": _quantile(ttfts, 0.99),
            "tpot_p50": _quantile(tpots, 0.5), "tpot_p99": _quantile(tpots, 0.99)}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(int(q * 100), 99) - 1]


def profile_later(url: str, seconds: float) -> threading.Thread:
    """A thread that records the engine core for `seconds` now, then prints the head of its op table."""

    def record() -> None:
        try:
            httpx.post(url + "/start_profile", timeout=150).raise_for_status()
            time.sleep(seconds)
            written = httpx.post(url + "/stop_profile", timeout=600).json()
        except httpx.HTTPError as exc:
            print(f"  the profile failed: {exc}", flush=True)
            return
        head = Path(written["ops"]).read_text().splitlines()[:40]
        print(f"  profile {written['trace']}; costliest host ops:\n" + "\n".join(head), flush=True)

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    return thread


def engine_counters(url: str) -> dict[str, float]:
    """devmap's engine-loop seconds per phase, its decode steps and its time-to-first-token histogram (as
    "ttft<=BOUND" counts) so far, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("devmap_engine_seconds_total{"):
            out[line.split('phase="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("devmap_decode_steps_total "):
            out["steps"] = float(line.split()[-1])
        elif line.startswith("devmap_time_to_first_token_seconds_bucket{"):
            out["ttft<=" + line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith(("devmap_stage_busy_seconds_total{", "devmap_stage_sampled_seconds_total{")):
            kind = "busy" if line.startswith("devmap_stage_busy") else "sampled"
            stage = line.split('stage="')[1].split('"')[0]
            out[f"{kind}@{stage}"] = float(line.split()[-1])
    return out


def busy_shares(before: dict[str, float], after: dict[str, float]) -> str:
    """Each pipeline stage's busy share over a window (its GPU's work time over the sampled spans: devmap's
    `devmap_stage_busy_share`, summed over the window's sampled steps)."""
    shares = []
    for key in sorted(k for k in after if k.startswith("busy@")):
        stage = key[5:]
        sampled = after.get(f"sampled@{stage}", 0) - before.get(f"sampled@{stage}", 0)
        if sampled > 0:
            shares.append(f"stage {stage} {100 * (after[key] - before.get(key, 0)) / sampled:.0f}%")
    return ", ".join(shares) or "-"


def server_ttft_p99(before: dict[str, float], after: dict[str, float]) -> str:
    """The server's own p99 time to first token over a window (submit to the first token's text, as the API side
    saw it), as the histogram bucket it falls in: the part of the clients' figure the service itself spends."""
    bounds = sorted((float(k[6:]), after[k] - before.get(k, 0)) for k in after if k.startswith("ttft<="))
    total = bounds[-1][1] if bounds else 0
    for bound, count in bounds:
        if total and count >= 0.99 * total:
            return f"<= {bound:g} s"
    return "-"


def gpu_pace() -> tuple[float, float]:
    """(bytes per second this GPU reads and writes, `common.copy_bandwidth`; bf16 operations per second its tensor
    cores sustain, `common.matmul_flops`), from a fresh process: the benchmark forks its clients and must hold no GPU
    context."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "from common import copy_bandwidth, matmul_flops; print(copy_bandwidth(), matmul_flops())\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def model_bytes(path: Path, quantize: str | None = None) -> tuple[int, int]:
    """(bytes a decode step reads of the weights: all but the input embedding, of which it reads a row each; KV
    cache bytes per token of context) of a saved bf16 checkpoint, served as it is or with `--quantize`: the blocks'
    Linear weights then at the scheme's bytes per weight plus the scales its library keeps beside them."""
    from devmap.planning.quantization import parse_quantization, weight_extra_bytes

    quantization = parse_quantization(quantize)
    weights = 0
    for name, shape in tensor_shapes(path):
        if "embed_tokens" not in name:
            count = 1
            for n in shape:
                count *= n
            if quantization is not None and ".layers." in name and name.endswith(".weight") and len(shape) == 2:
                weights += count * quantization.bits // 8 + weight_extra_bytes(quantization, *shape)
            else:
                weights += count * 2  # bf16
    config = json.loads((path / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 2
    return weights, kv


def tensor_shapes(path: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the checkpoint, or, for a config-only directory (--load-format dummy), of
    every parameter of the model its config describes (built on the meta device)."""
    from safetensors import safe_open

    files = list(path.glob("*.safetensors"))
    if not files:
        from devmap.planning.models import resolve_source

        for name, parameter in resolve_source(str(path)).build("meta").named_parameters():
            yield name, tuple(parameter.shape)
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                yield name, tuple(f.get_slice(name).get_shape())


def decoder_parameters_of(path: Path) -> int:
    """The parameters a decode step reads per token (`mixed_joins.decoder_parameters`), from the model's config."""
    from transformers import AutoConfig

    from devmap.generation.mixed_joins import decoder_parameters

    return decoder_parameters(AutoConfig.from_pretrained(str(path), local_files_only=True))


def devmap_variant(system: str) -> tuple[list[str], str | None]:
    """`devmap+int8+compile@DIR` → (the extra flags of devmap serve, the --quantize scheme or None): `+int8`,
    `+int4`, `+nf4`, `+fp8` serve quantized, `+compile` / `+no-compile` set compiling (`+beside` / `+first`: while
    serving / before, at every start),
    `+ride` / `+no-ride` whether joiners ride the decode steps; `+tp` (tensor parallelism over the row's GPUs) is
    added per row (`split_flags`)."""
    flags, scheme = [], None
    for part in system.split("@", 1)[0].split("+")[1:]:
        if part in ("int8", "int4", "nf4", "fp8"):
            flags, scheme = [*flags, "--quantize", part], part
        elif part in ("compile", "no-compile", "ride", "no-ride"):
            flags.append(f"--{part}")
        elif part in ("beside", "first"):
            flags.append(f"--compile-{part}")
        elif part != "tp":
            raise SystemExit(f"unknown variant +{part} in {system!r}: use +int8, +int4, +nf4, +fp8, +compile, "
                             "+no-compile, +beside, +first, +ride, +no-ride or +tp")
    return flags, scheme


def splits(system: str) -> bool:
    """Whether the system serves with tensor parallelism (`+tp`): every block split over the row's GPUs."""
    return "tp" in system.split("@", 1)[0].split("+")[1:]


def split_flags(system: str, devmap_args: str, gpus: int | None) -> list[str]:
    """devmap serve's flags for a row: `--devmap-args`, and for a `+tp` system `--tensor-parallel` over the row's GPUs
    instead of its placement flags (--device-map, --lanes)."""
    words = devmap_args.split()
    if not splits(system):
        return words
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--device-map", "--lanes"):
            skip = True
        else:
            kept.append(word)
    return [*kept, "--tensor-parallel", str(gpus or 1)] if (gpus or 1) > 1 else kept


def transformers_scheme(system: str) -> str | None:
    """`transformers+nf4` → "nf4" (the scheme of a pre-quantized checkpoint: +int8, +int4, +nf4, +fp8),
    `transformers` → None."""
    parts = system.split("+")[1:]
    if len(parts) > 1 or any(p not in ("int8", "int4", "nf4", "fp8") for p in parts):
        raise SystemExit(f"unknown variant in {system!r}: use transformers, transformers+int8, +int4, +nf4 or +fp8")
    return parts[0] if parts else None


def quantized_copy(model: str, path: Path, scheme: str) -> Path:
    """The preset `model` saved pre-quantized with `scheme` beside its checkpoint at `path` (written once, from the
    same seed: the same weights as the checkpoint that `main` writes)."""
    copy = path.with_name(f"{path.name}-{scheme}")
    if not (copy / "config.json").exists():
        subprocess.run([sys.executable, "-m", "devmap", "save", model, str(copy), "--dtype", "bfloat16",
                        "--quantize", scheme], check=True, stdout=subprocess.DEVNULL)
    return copy


def floor_seconds(row: dict[str, Any], weights: int, kv_per_token: int, bandwidth: float, new: int, stages: int = 1,
                  lanes: int = 1, parameters: int = 0, flops: float = 0.0,
                  split: bool = False) -> tuple[float, str] | None:
    """The least time a decode step (a round of every lane) of this load can take, and what bounds it ("reads" or
    "FLOPs"). Reads, from HBM: each of `stages` GPUs reads its share of the weights once per lane that holds requests
    and its share of every running request's KV cache (mean prompt + half the new tokens); and a lane's step goes
    through every stage one after the other, reading all the weights and its own requests' KV cache. FLOPs, on the
    tensor cores (`flops` per second, `parameters` read per token): every running request's token of the round and
    the prompt tokens the round takes in beside them (the load's prompt tokens per output token), 2 per parameter,
    spread over the stages the lanes keep busy. `split` (tensor parallelism over `stages` GPUs): each GPU reads
    1/`stages` of the weights and the KV cache and does 1/`stages` of the arithmetic every step (all-reduces not
    counted)."""
    if row.get("mean_prompt_tokens") is None:
        return None
    kv = row["clients"] * (row["mean_prompt_tokens"] + new / 2) * kv_per_token
    reads = max(lanes * weights / stages + kv / stages, weights + kv / lanes) / bandwidth
    out = row.get("mean_new_tokens") or new
    tokens = row["clients"] * (1 + row["mean_prompt_tokens"] / out)
    compute = tokens * 2 * parameters / (min(lanes, stages) * flops) if flops and parameters else 0.0
    if split:  # every GPU reads its share of the weights and of the KV cache, and does its share of the arithmetic
        reads = (weights + kv) / (stages * bandwidth)
        compute = tokens * 2 * parameters / (stages * flops) if flops and parameters else 0.0
    return (reads, "reads") if reads >= compute else (compute, "FLOPs")


def gpu_counts(system: str, counts: list[int] | None) -> list[int | None]:
    """The GPU counts a system is served on: each of `counts` for devmap (None: every visible GPU, as it is)."""
    return list(counts) if counts and system.startswith("devmap") else [None]


def lanes_of(devmap_args: str, gpus: int, clients: int) -> int:
    """The lanes holding requests when devmap serve runs `clients` clients on `gpus` GPUs: joiners go to the lane
    holding the fewest rows, so every lane holds some once there are as many clients; of `--lanes N` in its flags,
    else one per stage."""
    words = devmap_args.split()
    lanes = int(words[words.index("--lanes") + 1]) if "--lanes" in words else gpus
    return max(1, min(lanes, clients))


def transformers_command(path: Path, port: int) -> list[str]:
    """`transformers serve PATH` with the best flags this release knows. Continuous batching keeps its paged
    cache on one device (with `--device auto` spreading the model over two GPUs its worker dies on a cross-device
    index_copy), so the model goes on cuda:0: the 1.1B and 13B shapes fit one H200."""
    base = [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    help_text = subprocess.run(base + ["--help"], capture_output=True, text=True).stdout
    flags = [f for f in ("--continuous-batching", "--compile") if f in help_text]
    if "--device" in help_text:
        flags += ["--device", "cuda:0" if "--continuous-batching" in flags else "auto"]
    print(f"  transformers serve flags: {' '.join(flags)}", flush=True)
    return base + [str(path), "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", *flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--clients", default="1,8,32,64")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds of the same load before each timed window (steady state after first batches)")
    parser.add_argument("--new", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--systems", default="devmap,transformers",
                        help="devmap, transformers, or devmap@DIR: devmap's sources in DIR (another release of it, "
                             "as a baseline in the same run); devmap+int8 (+int4, +nf4, +fp8): served with --quantize, "
                             "its floor reading the quantized weights; +compile / +no-compile / +beside / +first; "
                             "+ride / +no-ride; "
                             "transformers+int8 (+int4, +nf4, +fp8): a pre-quantized copy of the checkpoint")
    parser.add_argument("--prompt-words", default="16,64,128,256", help="prompt lengths drawn from, in words")
    parser.add_argument("--devmap-args", default="--device-map balanced",
                        help="extra flags of devmap serve (e.g. add --no-compile: captured eager steps)")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes the clients are spread over (one event loop each)")
    parser.add_argument("--checkpoint", default=None,
                        help="the checkpoint folder: used if it holds one, else written there (default: a temporary "
                             "folder); several runs then share one")
    parser.add_argument("--restart", action="store_true",
                        help="start each server once more after its runs and report how long it takes to answer with "
                             "the on-disk caches its first start filled (inductor's, Triton's, devmap's regions), and "
                             "its first window of the first client count: a restart")
    parser.add_argument("--gpus", default=None,
                        help="GPU counts to serve each devmap system on, e.g. 1,2,4 (the first N GPUs of the machine); "
                             "default: every visible GPU, one row per system")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: write the configs and tokenizer only (devmap save --config-only) and serve random "
                             "weights made on the GPUs (devmap serve --load-format dummy; quantized there for "
                             "devmap+int8 and the like): a model whose checkpoint would not fit the disk or take "
                             "minutes to write; devmap systems only")
    parser.add_argument("--profile-seconds", type=float, default=0.0,
                        help="devmap systems: record the engine core (torch.profiler: host ops, CUDA calls, kernels) "
                             "for this many seconds at the start of each timed window, of the first window while "
                             "its steps compile beside and of the first window after a restart (POST /start_profile, "
                             "/stop_profile) and print its costliest host ops; the trace and op table go to "
                             "OUT/profiles. The profiled rows carry the profiler's overhead.")
    parser.add_argument("--cpu-check", action="store_true",
                        help="run every row on the CPU (devmap systems; +tp over gloo processes) with placeholder "
                             "floors: a check that the script and its servers run end to end, not a measurement")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.cpu_check and any(not system.startswith("devmap") for system in args.systems.split(",")):
        parser.error("--cpu-check runs devmap's own systems only")
    dummy = args.load_format == "dummy"
    if dummy and any(not system.startswith("devmap") for system in args.systems.split(",")):
        parser.error("--load-format dummy serves devmap's own systems only (transformers serve reads a checkpoint)")
    counts = [int(c) for c in args.clients.split(",")]
    gpus_list = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    rows: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEVMAP_BENCH_TMP")) as folder:
        path = Path(args.checkpoint).resolve() if args.checkpoint else Path(folder) / args.model
        if not (path / "config.json").exists():
            subprocess.run([sys.executable, "-m", "devmap", "save", args.model, str(path), "--dtype", "bfloat16",
                            *(["--config-only"] if dummy else [])], check=True, stdout=subprocess.DEVNULL)
        bandwidth, flops = (1e11, 1e12) if args.cpu_check else gpu_pace()
        weights, kv_per_token = model_bytes(path)
        parameters = decoder_parameters_of(path)
        print(f"HBM {bandwidth / 1e12:.2f} TB/s (copy, this GPU), bf16 {flops / 1e12:.0f} TFLOP/s (8192³ product); "
              f"weights read per step {weights / 1e9:.2f} GB; KV {kv_per_token / 1024:.0f} KiB per token", flush=True)
        systems = args.systems.split(",")
        variants = {system: devmap_variant(system) for system in systems if system.startswith("devmap")}
        schemes = {system: scheme for system, (_, scheme) in variants.items()}
        schemes.update({system: transformers_scheme(system) for system in systems if system.startswith("transformers")})
        read = {system: model_bytes(path, scheme)[0] if scheme else weights  # each system's weight bytes per step
                for system, scheme in schemes.items()}
        for system, gpus in [(system, gpus) for system in systems for gpus in gpu_counts(system, gpus_list)]:
            port = free_port()
            env = tree = None
            if "@" in system:  # devmap from another source tree (run from there: `-m` puts the cwd first)
                tree = str(Path(system.split("@", 1)[1]).resolve())
                paths = [tree, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(Path(p).resolve()) for p in paths)}
            name = system if gpus is None else f"{system}/{gpus}gpu"
            if gpus is not None or args.cpu_check:
                visible = "" if args.cpu_check else ",".join(str(g) for g in range(gpus or 0))
                env = {**(env or os.environ), "CUDA_VISIBLE_DEVICES": visible}
            if system.startswith("devmap"):
                command = [sys.executable, "-m", "devmap", "serve", str(path), "--port", str(port), "--dtype",
                           "bfloat16", "--log-level", "debug", "--max-queue", "4096",
                           *(["--profile-dir", str(Path(args.out or ".").resolve() / "profiles")]
                             if args.profile_seconds else []),
                           *split_flags(system, args.devmap_args, gpus), *variants[system][0],
                           *(["--load-format", "dummy"] if dummy else [])]
                model = path.name
            else:
                served = quantized_copy(args.model, path, schemes[system]) if schemes[system] else path
                command, model = transformers_command(served, port), str(served)
            with server(command, port, name, env=env, cwd=tree) as (url, cold):
                compiled = {}
                if system.startswith("devmap"):  # it serves on eager steps until its compiled ones take over
                    windows, waited = while_compiling(url, model, counts[0], args.seconds, args.new,
                                                      [int(w) for w in args.prompt_words.split(",")],
                                                      profile=args.profile_seconds)
                    compiled = {"compiled_s": cold + waited, "while_compiling": windows, "start": start_phases(url)}
                    print(f"  {name} start: {phases_line(compiled['start'])}", flush=True)
                    print(f"  {name}: {compiling_line(cold + waited, windows, counts[0])}", flush=True)
                for clients in counts:
                    before: dict[str, float] = {}
                    with profiled(url, args.profile_seconds) as profile_from_here:

                        def timed(url: str = url, profile: Any = profile_from_here) -> None:
                            before.update(engine_counters(url))  # the timed window's counters, without its warm-up's
                            if profile is not None:
                                profile()

                        row = load_test(url, model, clients, args.seconds, args.new, seed=clients,
                                        lengths=[int(w) for w in args.prompt_words.split(",")], warmup=args.warmup,
                                        processes=args.client_processes,
                                        timed=timed if system.startswith("devmap") else None)
                    if before:  # where the engine loop's time went in the timed window, per decode step
                        after = engine_counters(url)
                        steps = after.get("steps", 0) - before.get("steps", 0)
                        row["engine_ms_per_step"] = {k: 1000 * (v - before.get(k, 0)) / steps for k, v in after.items()
                                                     if k != "steps" and not k.startswith(("ttft", "busy@", "sampled@"))
                                                     } if steps else {}
                        row["stages_busy"] = busy_shares(before, after)
                        row["steps"] = steps
                        row["server_ttft_p99"] = server_ttft_p99(before, after)
                    stages = gpus or 1
                    floor = floor_seconds(row, read.get(system, weights), kv_per_token, bandwidth, args.new, stages,
                                          lanes_of(args.devmap_args, stages, clients) if stages > 1 else 1,
                                          parameters, flops, split=splits(system))
                    rows.setdefault(name, []).append({**row, **compiled, "cold_start_s": cold,
                                                      "floor_s": floor[0] if floor else None,
                                                      "floor_bound": floor[1] if floor else None,
                                                      "hbm_bytes_per_s": bandwidth, "bf16_flops": flops, "gpus": gpus})
                    if args.out:  # every row as it comes: a run stopped short keeps the rows it made
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        (Path(args.out) / f"serve_{args.model}.json").write_text(json.dumps(rows, indent=2))
                    # batch sizes, first-token times: as the server saw them
                    if args.out and system.startswith("devmap"):
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        (Path(args.out) / f"metrics_{label(name)}_{args.model}_{clients}.txt").write_text(
                            httpx.get(url + "/metrics", timeout=10).text)
                    print(f"  {name} {clients} clients: {row['tokens_per_s']:.0f} tok/s, "
                          f"ttft p50 {row['ttft_p50']} p99 {row['ttft_p99']}", flush=True)
            if args.restart and rows.get(name):
                port = free_port()
                command[command.index("--port") + 1] = str(port)
                with server(command, port, f"{name}-restart", env=env, cwd=tree) as (again_url, again):
                    lengths = [int(w) for w in args.prompt_words.split(",")]
                    is_devmap = system.startswith("devmap")
                    windows, waited = (while_compiling(again_url, model, counts[0], args.seconds, args.new, lengths,
                                                       profile=args.profile_seconds) if is_devmap else ([], 0.0))
                    # the first window on compiled steps: a new batch shape's captures, kernels' first loads (for
                    # transformers serve, whose compile runs at its first requests, that compile too)
                    with profiled(again_url, args.profile_seconds if is_devmap else 0.0) as timed:
                        first = load_test(again_url, model, counts[0], args.seconds, args.new, seed=len(windows),
                                          lengths=lengths, timed=timed)
                    rows[name][0].update(restart_s=again, restart_first_window=first)
                    if is_devmap:
                        rows[name][0].update(restart_compiled_s=again + waited, restart_while_compiling=windows,
                                             restart=start_phases(again_url))
                        print(f"  {name} restart: {phases_line(rows[name][0]['restart'])}", flush=True)
                        print(f"  {name} restart: {compiling_line(again + waited, windows, counts[0])}", flush=True)
                    when = "on compiled steps" if system.startswith("devmap") else "after it answered"
                    print(f"  {name} restart: the first window of {counts[0]} clients {when}: "
                          f"{first['tokens_per_s']:,.0f} tok/s, TTFT p99 {first['ttft_p99'] or 0:.2f} s", flush=True)
    report(args.model, rows, counts, args.out, schemes)


def report(model: str, rows: dict[str, list[dict[str, Any]]], counts: list[int], out: str | None,
           schemes: dict[str, str | None] | None = None) -> None:
    print(f"\nserving {model}, streaming chat completions, greedy")
    print("| system | clients | requests | first call s | output tok/s | TTFT p50 / p99 s "
          "| time per token p50 / p99 ms | floor ms (bound) | floor ÷ step | vs transformers | vs 1 GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for system, results in rows.items():
        base = system.rsplit("/", 1)[0]
        scheme = (schemes or {}).get(base)
        peer_rows = rows.get(f"transformers+{scheme}") if scheme and not system.startswith("transformers") else None
        peer = {r["clients"]: r["tokens_per_s"] for r in peer_rows or rows.get("transformers", [])}
        one = {r["clients"]: r["tokens_per_s"] for r in rows.get(f"{base}/1gpu", [])} if base != system else {}
        for r in results:
            ratio = f"{r['tokens_per_s'] / peer[r['clients']]:.2f}x" if peer.get(r["clients"]) else "-"
            scaling = f"{r['tokens_per_s'] / one[r['clients']]:.2f}x" if one.get(r["clients"]) else "-"
            ttft = f"{_fmt(r['ttft_p50'])} / {_fmt(r['ttft_p99'])}"
            token = f"{_fmt(r['tpot_p50'], 1000)} / {_fmt(r['tpot_p99'], 1000)}"
            print(f"| {system} | {r['clients']} | {r['requests']} | {r['first_call_s']:.2f} | {r['tokens_per_s']:,.0f} "
                  f"| {ttft} | {token} | {_fmt(r['floor_s'], 1000)} ({r.get('floor_bound') or '-'}) | "
                  f"{_share(r['floor_s'], r['tpot_p50'])} | "
                  f"{ratio} | {scaling} |")
    for system, results in rows.items():
        for r in results:
            if r.get("engine_ms_per_step"):
                parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["engine_ms_per_step"].items()))
                print(f"{system} {r['clients']} clients: engine loop ms per decode step ({r['steps']:.0f} steps): "
                      f"{parts}; the server's own TTFT p99 {r.get('server_ttft_p99', '-')}; GPUs busy (sampled "
                      f"steps): {r.get('stages_busy', '-')}")
    cold = ", ".join(f"{system} {results[0]['cold_start_s']:.1f} s" for system, results in rows.items() if results)
    print(f"cold start (a fresh server process until it answers): {cold}")
    ready = ", ".join(f"{system} {results[0]['compiled_s']:.1f} s" for system, results in rows.items()
                      if results and "compiled_s" in results[0])
    if ready:
        print(f"compiled steps serving (a fresh server process until its compile beside serving ended): {ready}")
    again = ", ".join(f"{system} {results[0]['restart_s']:.1f} s" for system, results in rows.items()
                      if results and "restart_s" in results[0])
    if again:
        print(f"restart (the same server started again, its on-disk compile caches filled): {again}")
    again = ", ".join(f"{system} {results[0]['restart_compiled_s']:.1f} s" for system, results in rows.items()
                      if results and "restart_compiled_s" in results[0])
    if again:
        print(f"restart until its compiled steps serve: {again}")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"serve_{model}.json").write_text(json.dumps(rows, indent=2))


def _share(floor: float | None, step: float | None) -> str:
    return "-" if not floor or not step else f"{100 * floor / step:.0f}%"


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.3f}"


if __name__ == "__main__":
    main()
