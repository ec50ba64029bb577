"""Hostile traffic: `devmap serve` under N streaming greedy clients while a bad request comes every second.

Run on nvidia-h200-x2 (the wheels of fastapi, uvicorn and pydantic travel with the command):
    PYTHONPATH=. python3 benchmarks/serve_faults.py --model llama-2-13b --gpus 1,2 --clients 64 --seconds 60
The checkpoint is `devmap save MODEL` (random bf16 weights), written once; the server is started on the first 1, then
2, ... GPUs of the machine (CUDA_VISIBLE_DEVICES) with `--device-map balanced`. For each:
1. each of 16 fixed prompts is sent alone (greedy completions, `--new` tokens): its reference text;
2. a control window (`--control` seconds): the clients send those prompts back to back, streaming; each answer is
   compared with its prompt's reference;
3. the hostile window (`--seconds`): the same load, and every second one bad request (a token id past the vocabulary,
   -1, 2**70, a seed of 2**64 or 10**23, in turn).
Reported per GPU count: requests, errors seen by the clients (a non-200 answer or an error event in a stream), the
share of answers equal to their reference in each window and the share equal to the control window's most common
answer to the same prompt, the bad requests and how many got 400 naming their field, and output tokens/s.

Greedy text is a test of exactness only where the model's choices do not hang on rounding: with random weights in
bfloat16, logits are close enough that a batch's products rounding differently (another row count, another kernel)
changes a token, so a 13B bf16 model's answers under load differ from its answers alone with or without bad requests;
`--dtype float32` on a small preset (`llama-tiny`) gives the same greedy text whatever the batch, and there every
answer must equal its reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import free_port, server  # noqa: E402  (benchmarks/serve.py: a server process until it answers)

PROMPTS = [" ".join(["the quick brown fox jumps over the lazy dog"] * (1 + i % 6)) + f" {i}" for i in range(16)]
BAD = [({"prompt": "VOCAB"}, "prompt"), ({"prompt": [-1, 5]}, "prompt"), ({"prompt": [5, 2 ** 70]}, "prompt"),
       ({"prompt": "Hello", "seed": 2 ** 64}, "seed"), ({"prompt": "Hello", "seed": 10 ** 23}, "seed")]


async def completion(http: httpx.AsyncClient, model: str, prompt: str, new: int) -> tuple[str | None, int]:
    """One streaming greedy completion: its text (None where it failed) and its output tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    text, tokens = "", 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return None, tokens
            text += chunk["choices"][0]["text"]
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return text, tokens


async def window(url: str, model: str, clients: int, seconds: float, new: int, reference: list[str],
                 vocab: int, hostile: bool) -> dict[str, Any]:
    """`clients` clients asking back to back for `seconds` (and a bad request every second if `hostile`)."""
    stats: dict[str, Any] = {"requests": 0, "errors": 0, "same": 0, "tokens": 0, "bad": 0, "bad_400": 0,
                             "texts": [{} for _ in PROMPTS]}  # per prompt: each answer and how often it came
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def client(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                text, tokens = await completion(http, model, PROMPTS[i % len(PROMPTS)], new)
                stats["requests"] += 1
                stats["errors"] += text is None
                stats["same"] += text == reference[i % len(PROMPTS)]
                stats["tokens"] += tokens
                seen = stats["texts"][i % len(PROMPTS)]
                seen[text] = seen.get(text, 0) + 1
                i += 1

        async def attacker() -> None:
            k = 0
            while time.monotonic() < stop_at:
                extra, field = BAD[k % len(BAD)]
                if extra.get("prompt") == "VOCAB":
                    extra = {"prompt": [5, vocab, 7]}
                response = await http.post("/v1/completions", json={"model": model, "max_tokens": 4, **extra})
                stats["bad"] += 1
                error = response.json().get("error") or {}
                stats["bad_400"] += response.status_code == 400 and error.get("param") == field
                k += 1
                await asyncio.sleep(1.0)

        started = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(clients)), *([attacker()] if hostile else []))
        stats["seconds"] = time.monotonic() - started
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-13b")
    parser.add_argument("--gpus", default="1,2", help="GPU counts, each the first N GPUs of the machine")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0, help="the hostile window")
    parser.add_argument("--control", type=float, default=20.0, help="the control window, without bad requests")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="of the checkpoint and the served model")
    parser.add_argument("--checkpoint", default=None, help="folder of the checkpoint: used if there, else written")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEVMAP_BENCH_TMP")) as folder:
        path = Path(args.checkpoint).resolve() if args.checkpoint else Path(folder) / args.model
        if not (path / "config.json").exists():
            subprocess.run([sys.executable, "-m", "devmap", "save", args.model, str(path), "--dtype", args.dtype],
                           check=True, stdout=subprocess.DEVNULL)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        for gpus in [int(g) for g in args.gpus.split(",")]:
            port = free_port()
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(gpus))}
            command = [sys.executable, "-m", "devmap", "serve", str(path), "--port", str(port), "--dtype", args.dtype,
                       "--device-map", "balanced", "--max-tokens", str(args.new), "--max-prompt-tokens", "512",
                       "--max-queue", "4096", "--log-level", "warning"]
            with server(command, port, f"devmap-{gpus}gpu", env=env) as (url, cold):
                reference = asyncio.run(_references(url, path.name, args.new))
                control = asyncio.run(window(url, path.name, args.clients, args.control, args.new, reference, vocab,
                                             False))
                hostile = asyncio.run(window(url, path.name, args.clients, args.seconds, args.new, reference, vocab,
                                             True))
            rows.append({"gpus": gpus, "cold_start": cold, "control": control, "hostile": hostile})
            print(json.dumps(rows[-1]), flush=True)
    report(args, rows)


async def _references(url: str, model: str, new: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        texts = [await completion(http, model, prompt, new) for prompt in PROMPTS]
    if any(text is None for text, _ in texts):
        raise RuntimeError("a reference request failed")
    return [text for text, _ in texts]


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import torch
    import transformers

    lines = [f"{args.model} ({args.dtype}), {args.clients} streaming greedy clients, {args.new} new tokens, control "
             f"{args.control:g} s then hostile {args.seconds:g} s; torch {torch.__version__}, transformers "
             f"{transformers.__version__}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}",
             "",
             "| GPUs | requests (control / hostile) | client errors | text = alone (control / hostile) "
             "| text = control's commonest (control / hostile) | bad requests: 400 naming the field | tok/s (hostile) "
             "| cold start |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        c, h = row["control"], row["hostile"]
        common = [max(seen, key=seen.get) if seen else None for seen in c["texts"]]
        agree = [sum(n for text, n in w["texts"][i].items() if text == common[i]) for w in (c, h)
                 for i in range(len(PROMPTS))]
        half = len(PROMPTS)
        alone = f"{c['same'] / max(c['requests'], 1):.1%} / {h['same'] / max(h['requests'], 1):.1%}"
        usual = f"{sum(agree[:half]) / max(c['requests'], 1):.1%} / {sum(agree[half:]) / max(h['requests'], 1):.1%}"
        lines.append(f"| {row['gpus']} | {c['requests']} / {h['requests']} | {c['errors'] + h['errors']} | {alone} | "
                     f"{usual} | {h['bad_400']} of {h['bad']} | {h['tokens'] / h['seconds']:,.0f} | "
                     f"{row['cold_start']:.1f} s |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_faults.md").write_text(text + "\n")
        (Path(args.out) / "serve_faults.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
