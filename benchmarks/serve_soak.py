"""A soak: `devmap serve` under steady streaming load for minutes, with clients that go away mid-stream and prompts
longer than the service takes, checked for errors, leaks and rows left behind.

Run on nvidia-h200-x2 (the wheels of fastapi, uvicorn and pydantic travel with the command):
    PYTHONPATH=. python3 benchmarks/serve_soak.py --model llama-2-13b --gpus 2 --clients 64 --minutes 10 --out $OUT
The checkpoint is `devmap save MODEL` (random bf16 weights), written once (or `--checkpoint DIR`); the server runs on
the machine's first `--gpus` GPUs with `--device-map balanced` and `--max-prompt-tokens 512`. Each of `--clients`
clients sends streaming chat completions back to back (greedy, `--new` tokens, prompts of 16-256 words); of its
requests, a `--disconnect` share reads two chunks and closes the connection, and a `--too-long` share sends a prompt of
600-2,000 words, which the service must refuse with a 4xx naming the reason. Every `--sample` seconds the script reads
`/metrics` (rows running, queue depth, each GPU's allocated memory) and the resident memory of the server's processes.
Reported: requests by outcome, 5xx answers and errors inside streams (none allowed), refusals with and without a
reason, output tokens/s, the rows running and requests queued once the load stops (zero within 30 s), and each GPU's
memory and the processes' RSS from minute `--steady` to the end (flat: within ±2%).
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
from serve import WORDS, free_port, server  # noqa: E402  (benchmarks/serve.py)


async def one(http: httpx.AsyncClient, model: str, kind: str, rng: random.Random, new: int) -> dict[str, Any]:
    """One request of `kind` (normal, disconnect, too_long): what came of it."""
    words = rng.randint(600, 2000) if kind == "too_long" else rng.choice((16, 64, 128, 256))
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new, "temperature": 0,
            "stream": True}
    out: dict[str, Any] = {"kind": kind, "status": None, "tokens": 0, "reason": None, "stream_error": None}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            try:
                out["reason"] = (json.loads(text).get("error") or {}).get("message")
            except ValueError:
                out["reason"] = None
            return out
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["stream_error"] = chunk["error"].get("message", "error")
                return out
            chunks += 1
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                out["tokens"] += 1
            if kind == "disconnect" and chunks >= 2:
                return out  # leaving the block closes the connection mid-stream
    return out


async def load(url: str, model: str, clients: int, seconds: float, new: int, disconnect: float, too_long: float,
               sample: float, pids: list[int], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The load for `seconds`, sampled every `sample` seconds: (the requests' outcomes, the samples)."""
    results: list[dict] = []
    samples: list[dict] = []
    stop_at = time.monotonic() + seconds
    started = time.monotonic()
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def client(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            while time.monotonic() < stop_at:
                draw = rng.random()
                kind = "too_long" if draw < too_long else "disconnect" if draw < too_long + disconnect else "normal"
                try:
                    results.append(await one(http, model, kind, rng, new))
                except httpx.HTTPError as exc:
                    results.append({"kind": kind, "status": None, "tokens": 0, "reason": None,
                                    "stream_error": f"{type(exc).__name__}: {exc}"})

        async def sampler() -> None:
            while time.monotonic() < stop_at:
                await asyncio.sleep(sample)
                samples.append({"t": time.monotonic() - started, **await read_state(http, pids)})

        await asyncio.gather(*(client(k) for k in range(clients)), sampler())
        for _ in range(60):  # the load stopped: rows and queue back to zero
            state = await read_state(http, pids)
            if state["running"] == 0 and state["queue"] == 0:
                break
            await asyncio.sleep(0.5)
        samples.append({"t": time.monotonic() - started, "after": True, **state})
    return results, samples


async def read_state(http: httpx.AsyncClient, pids: list[int]) -> dict[str, Any]:
    """Rows running, queue depth and each GPU's allocated bytes from /metrics, and the server processes' RSS."""
    text = (await http.get("/metrics")).text
    state: dict[str, Any] = {"running": None, "queue": None, "gpu": {}, "rss": tree_rss(pids)}
    for line in text.splitlines():
        if line.startswith("devmap_running_requests "):
            state["running"] = float(line.split()[-1])
        elif line.startswith("devmap_queue_depth "):
            state["queue"] = float(line.split()[-1])
        elif line.startswith("devmap_device_memory_bytes{"):
            state["gpu"][line.split('device="')[1].split('"')[0]] = float(line.split()[-1])
    return state


def tree_rss(pids: list[int]) -> int:
    """Resident bytes of the processes `pids` and all their descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, list(pids)
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def summary(results: list[dict], samples: list[dict], seconds: float, steady: float) -> dict[str, Any]:
    """The soak's figures: outcomes, errors, refusals, tokens/s, what was left once it stopped, memory drift."""
    by_kind = {kind: [r for r in results if r["kind"] == kind] for kind in ("normal", "disconnect", "too_long")}
    five = [r for r in results if r["status"] is not None and r["status"] >= 500]
    stream_errors = [r for r in results if r["kind"] != "too_long" and r["stream_error"]]
    refused = [r for r in results if r["status"] is not None and 400 <= r["status"] < 500]
    during = [s for s in samples if not s.get("after")]
    steady_samples = [s for s in during if s["t"] >= steady] or during[-1:]
    first, last = (steady_samples[0], steady_samples[-1]) if steady_samples else ({}, {})

    def drift(a: float | None, b: float | None) -> float | None:
        return None if not a or b is None else (b - a) / a

    after = samples[-1] if samples and samples[-1].get("after") else {}
    return {
        "requests": len(results), "normal": len(by_kind["normal"]), "disconnected": len(by_kind["disconnect"]),
        "too_long": len(by_kind["too_long"]),
        "too_long_refused_with_reason": sum(1 for r in by_kind["too_long"]
                                            if r["status"] and 400 <= r["status"] < 500 and r["reason"]),
        "refused_without_reason": sum(1 for r in refused if not r["reason"]),
        "normal_refused": sum(1 for r in by_kind["normal"] if r["status"] != 200),
        "status_5xx": len(five), "stream_errors": len(stream_errors),
        "examples": [r.get("reason") or r.get("stream_error") for r in (five + stream_errors)[:3]],
        "tokens_per_s": sum(r["tokens"] for r in results) / seconds,
        "running_after": after.get("running"), "queue_after": after.get("queue"),
        "gpu_drift": {d: drift(first.get("gpu", {}).get(d), last.get("gpu", {}).get(d)) for d in first.get("gpu", {})},
        "rss_drift": drift(first.get("rss"), last.get("rss")),
        "gpu_bytes": {d: (first.get("gpu", {}).get(d), last.get("gpu", {}).get(d)) for d in first.get("gpu", {})},
        "rss_bytes": (first.get("rss"), last.get("rss")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-13b")
    parser.add_argument("--gpus", type=int, default=2, help="the machine's first N GPUs")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--steady", type=float, default=2.0, help="memory is compared from this minute to the end")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--disconnect", type=float, default=0.1, help="share of requests that leave mid-stream")
    parser.add_argument("--too-long", type=float, default=0.02, help="share of requests with too long a prompt")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between two reads of /metrics")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--devmap-args", default="--device-map balanced", help="more flags of devmap serve")
    parser.add_argument("--checkpoint", default=None, help="folder of the checkpoint: used if there, else written")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: write the configs and tokenizer only and serve random weights made on the GPUs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dummy = args.load_format == "dummy"
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEVMAP_BENCH_TMP")) as folder:
        path = Path(args.checkpoint).resolve() if args.checkpoint else Path(folder) / args.model
        if not (path / "config.json").exists():
            subprocess.run([sys.executable, "-m", "devmap", "save", args.model, str(path), "--dtype", args.dtype,
                            *(["--config-only"] if dummy else [])], check=True, stdout=subprocess.DEVNULL)
        port = free_port()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(args.gpus))}
        command = [sys.executable, "-m", "devmap", "serve", str(path), "--port", str(port), "--dtype", args.dtype,
                   "--max-prompt-tokens", "512", "--max-tokens", str(args.new), "--max-queue", "4096",
                   "--log-level", "warning", *args.devmap_args.split(),
                   *(["--load-format", "dummy"] if dummy else [])]
        processes: list[Any] = []
        with server(command, port, f"soak-{args.gpus}gpu", env=env, processes=processes) as (url, cold):
            seconds = 60 * args.minutes
            results, samples = asyncio.run(load(url, path.name, args.clients, seconds, args.new, args.disconnect,
                                                args.too_long, args.sample, [p.pid for p in processes]))
    row = {"gpus": args.gpus, "cold_start": cold, **summary(results, samples, seconds, 60 * args.steady)}
    report(args, row, samples)


def report(args: argparse.Namespace, row: dict[str, Any], samples: list[dict]) -> None:
    import torch
    import transformers

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.1f}%"

    gpu = ", ".join(f"{d} {pct(v)}" for d, v in row["gpu_drift"].items()) or "-"
    lines = [f"{args.model} ({args.dtype}) on {args.gpus} GPU(s), {args.clients} streaming greedy clients, "
             f"{args.minutes:g} min, {args.new} new tokens, {args.disconnect:.0%} leaving mid-stream, "
             f"{args.too_long:.0%} too long; torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}",
             "",
             "| requests (normal / left mid-stream / too long) | 5xx | errors in streams | too long: 4xx with a reason "
             "| 4xx without a reason | tok/s | rows / queue after the load | GPU memory, minute "
             f"{args.steady:g} to end | server RSS, minute {args.steady:g} to end |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| {row['requests']} ({row['normal']} / {row['disconnected']} / {row['too_long']}) | "
             f"{row['status_5xx']} | {row['stream_errors']} | {row['too_long_refused_with_reason']} of "
             f"{row['too_long']} | {row['refused_without_reason']} | {row['tokens_per_s']:,.0f} | "
             f"{row['running_after']} / {row['queue_after']} | {gpu} | {pct(row['rss_drift'])} |"]
    if row["examples"]:
        lines.append(f"\nerrors, first ones: {row['examples']}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_soak.md").write_text(text + "\n")
        (Path(args.out) / "serve_soak.json").write_text(json.dumps({"row": row, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
