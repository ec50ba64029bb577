"""A model loaded over HTTP while another serves: how soon the new one answers, and what its load costs the streams
of the one already serving.

Run on nvidia-h200 (the wheels of fastapi, uvicorn and pydantic travel with the command):
    PYTHONPATH=. python3 benchmarks/serve_load.py --model llama-2-13b --load-format dummy --clients 32 --out $OUT
Two model directories of the same preset (`devmap save MODEL`, or its configs alone with `--load-format dummy`; the
second's files link to the first's) lie under one model root. `devmap serve ROOT/first --model-root ROOT` starts with
the first; `--clients` streaming clients (greedy chat, prompts of `--prompt-words` words, `--new` tokens) use it for
`--warmup` untimed seconds and `--seconds` timed ones (the steady window); then, with the same clients streaming,
`POST /v1/models/load {"model": "second"}` loads the second, and one request to it follows as soon as the load
answers. The service's limits (`--max-batch`, `--max-prompt-tokens`, `--max-tokens`) leave room for both models.
Reported: seconds from the load request until it answered and until the second model's first token, the second
model's load phases (as the service counts them), and the first model's time per token (p50 / p99 over requests),
longest pause between two chunks of one stream, and output tokens/s in the steady window against the requests that
overlapped the load; the weight-read floor of one decode step beside them. With `--rounds N` the second model is
unloaded and loaded again N-1 more times (the in-process compile already made for its shapes).
`--cpu-check` runs it on the CPU with a tiny preset: a check that the script runs end to end, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import WORDS, _quantile, free_port, gpu_pace, model_bytes, one_request, server  # noqa: E402


async def clients(url: str, model: str, count: int, until: list[float], new: int, seed: int, lengths: list[int],
                  into: list[dict[str, Any]]) -> None:
    """`count` clients sending requests back to back (prompts of `lengths` words) until the time in `until[0]` (which
    may move)."""
    rng = random.Random(seed)

    async def one(http: httpx.AsyncClient) -> None:
        while time.monotonic() < until[0]:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths)))
            into.append(await one_request(http, model, prompt, new))

    limits = httpx.Limits(max_connections=count + 4, max_keepalive_connections=count + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        await asyncio.gather(*(one(http) for _ in range(count)))


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The steady window, then the loads of the second model beside the same clients."""
    results: list[dict[str, Any]] = []
    begun = time.monotonic()
    until = [begun + 1e9]
    lengths = [int(n) for n in args.prompt_words.split(",")]
    streams = asyncio.create_task(clients(url, "first", args.clients, until, args.new, 0, lengths, results))
    await asyncio.sleep(args.warmup)
    steady = (time.monotonic(), time.monotonic() + args.seconds)
    await asyncio.sleep(args.seconds)
    loads = []
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        for round_ in range(args.rounds):
            if round_:
                (await http.delete("/v1/models/second")).raise_for_status()
                await asyncio.sleep(args.pause)
            sent = time.monotonic()
            answer = await http.post("/v1/models/load", json={"model": "second"})
            if answer.status_code != 200:
                raise RuntimeError(f"the load answered {answer.status_code}: {answer.text[:300]}")
            loaded = time.monotonic()
            first = await one_request(http, "second", "hello " * 8, 4)
            described = (await http.get("/v1/models/second")).json()
            loads.append({"sent": sent, "loaded_s": loaded - sent, "first_token_s": loaded + first["ttft"] - sent,
                          "load_seconds": described.get("load_seconds"),
                          "compiled_graphs": described.get("compiled_graphs"),
                          "window": (sent, loaded + first["ttft"])})
            await asyncio.sleep(args.pause)
    until[0] = time.monotonic()
    await streams
    return {"steady": summary(results, *steady), "loads": [
        {**load, "during": summary(results, *load.pop("window"))} for load in loads]}


def summary(results: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """The first model's requests whose streams overlapped [start, end]: their time per token and longest pause, and
    their tokens (each counted by the share of its stream's time inside) per second of the window."""
    inside = [r for r in results if r["sent"] < end and r["ended"] > start]
    tokens = sum(r["tokens"] * (min(r["ended"], end) - max(r["sent"], start)) / max(r["ended"] - r["sent"], 1e-9)
                 for r in inside)
    tpots = sorted(r["tpot"] for r in inside if r["tpot"] is not None)
    gaps = [r["gap"] for r in inside if r["gap"] is not None]
    return {"requests": len(inside), "tokens_per_s": tokens / max(end - start, 1e-9),
            "tpot_p50": _quantile(tpots, 0.5), "tpot_p99": _quantile(tpots, 0.99),
            "longest_gap": max(gaps) if gaps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-13b")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="the steady window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--pause", type=float, default=3.0, help="seconds of streaming after each load")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt-words", default="16,64,128,256", help="prompt lengths drawn from, in words")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--devmap-args", default="--device-map balanced", help="more flags of devmap serve")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dummy = args.load_format == "dummy"
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEVMAP_BENCH_TMP")) as folder:
        root = Path(folder)
        first, second = root / "first", root / "second"
        subprocess.run([sys.executable, "-m", "devmap", "save", args.model, str(first), "--dtype",
                        "float32" if args.cpu_check else "bfloat16", *(["--config-only"] if dummy else [])],
                       check=True, stdout=subprocess.DEVNULL)
        second.mkdir()
        for file in first.iterdir():
            (second / file.name).symlink_to(file)
        port = free_port()
        command = [sys.executable, "-m", "devmap", "serve", str(first), "--model-root", str(root), "--port", str(port),
                   "--max-batch", str(args.max_batch), "--max-prompt-tokens", str(args.max_prompt_tokens),
                   "--max-tokens", str(args.new), "--max-queue", "4096", "--log-level", "warning",
                   *args.devmap_args.split(), *(["--load-format", "dummy"] if dummy else [])]
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu_check else {})}
        bandwidth = 1e11 if args.cpu_check else gpu_pace()[0]
        weights = model_bytes(first)[0]
        with server(command, port, "serve-load", env=env) as (url, cold):
            row = asyncio.run(run(url, args))
    row.update(model=args.model, clients=args.clients, cold_start_s=cold, floor_ms=1e3 * weights / bandwidth)
    report(row, args)


def report(row: dict[str, Any], args: argparse.Namespace) -> None:
    import torch
    import transformers

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1e3 * value:.2f}"

    def line(name: str, part: dict[str, Any], base: dict[str, Any] | None) -> str:
        ratio = f"{part['tpot_p99'] / base['tpot_p99']:.2f}x" if base and part["tpot_p99"] and base["tpot_p99"] else "-"
        return (f"| {name} | {part['requests']} | {part['tokens_per_s']:,.0f} | {ms(part['tpot_p50'])} / "
                f"{ms(part['tpot_p99'])} | {ratio} | {ms(part['longest_gap'])} | {row['floor_ms']:.2f} |")

    print(f"\n{args.model}: a second model loaded over HTTP beside {args.clients} streaming clients of the first; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, cold start {row['cold_start_s']:.1f} s")
    print("| first model's requests | requests | output tok/s | time per token p50 / p99 ms | p99 vs steady "
          "| longest pause ms | floor ms (weights read) |")
    print("|---|---|---|---|---|---|---|")
    print(line("steady", row["steady"], None))
    for number, load in enumerate(row["loads"], 1):
        print(line(f"during load {number}", load["during"], row["steady"]))
    for number, load in enumerate(row["loads"], 1):
        phases = ", ".join(f"{p} {s:.2f} s" for p, s in (load["load_seconds"] or {}).items())
        graphs = load.get("compiled_graphs")
        made = f" ({graphs['total']} graphs, {graphs['from_cache']} from the cache)" if graphs else ""
        print(f"load {number}: answered {load['loaded_s']:.2f} s after the request, first token "
              f"{load['first_token_s']:.2f} s; phases {phases}{made}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"serve_load_{args.model}.json").write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
