"""Where a continuous batch's time to first token goes: closed-loop clients on `generate_continuous`, no HTTP.

Run on a GPU machine:  PYTHONPATH=. python3 benchmarks/probes/join_probe.py --model llama-2-13b [--profile]
Each of `--clients` clients sends its next request the moment its last one ends (prompt lengths drawn from
--lengths, in tokens), as `benchmarks/serve.py`'s clients do over HTTP. Prints tokens/s, time to first token
p50/p99, the host time spent issuing joins, and the GPU time of one join of every client at once, in devmap's packs
of several sizes and as one pack; `--profile` adds the join's top kernels; `--join` joins each layer's projections
first, as `devmap serve` does at load.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import devmap
import devmap.generation.joins
from devmap.generation.continuous import SlotRequest, generate_continuous
from devmap.generation.joined_projections import join_projections


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def closed_loop(model: torch.nn.Module, clients: int, lengths: list[int], new: int, seconds: float, rows: int,
                first_slot: int, cache_len: int, seed: int = 0, budget: int | None = None,
                compile: bool = False, riding: bool | None = None) -> dict[str, float]:
    """Clients that resend at once for `seconds`: output tokens/s, TTFT quantiles, join host seconds, steps. With
    `budget`, at most that many prompt tokens join at one step (beyond the first request), as `devmap serve`'s
    --join-tokens. `riding`: whether joiners ride the decode steps (`continuous_batch`'s; None: by model size)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size

    def request(client: int) -> SlotRequest:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice(lengths))]
        return SlotRequest(prompt, new, {"client": client, "arrived": time.perf_counter(), "tokens": 0,
                                         "prompt": prompt})

    queue = [request(c) for c in range(clients)]
    first, queue = queue[:rows], queue[rows:]
    ttft: list[float] = []
    produced = [0]
    end = time.perf_counter() + seconds

    def admit(free: int, longest: int, most: int) -> list[SlotRequest] | None:
        if time.perf_counter() > end or any(r.max_new_tokens > most for r in queue):
            return None  # time is up, or a request no longer fits the cache: a new batch (as the engine does)
        chosen, tokens = [], 0
        for r in queue:
            if len(chosen) < free and len(r.prompt) <= longest and (budget is None or not chosen
                                                                     or tokens + len(r.prompt) <= budget):
                chosen.append(r)
                tokens += len(r.prompt)
        for r in chosen:
            queue.remove(r)
        return chosen

    def emit(owner: dict, token: int) -> bool:
        if owner["tokens"] == 0:
            ttft.append(time.perf_counter() - owner["arrived"])
        owner["tokens"] += 1
        produced[0] += 1
        if owner["tokens"] >= new:
            queue.append(request(owner["client"]))
            return True
        return False

    stats = {"join_seconds": 0.0, "steps": 0}
    start = time.perf_counter()
    while time.perf_counter() < end:
        part: dict[str, float] = {}
        left = generate_continuous(model, first, admit, emit, rows=rows, first_slot=first_slot,
                                   cache_len=cache_len, compile=compile, stats=part, riding=riding)
        stats = {k: stats[k] + part[k] for k in stats}
        queue = [SlotRequest(r["prompt"], new - r["tokens"], r) for r in left] + queue
        first, queue = queue[:rows], queue[rows:]
    wall = time.perf_counter() - start
    ttft.sort()
    return {"tokens_per_s": produced[0] / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "requests": len(ttft),
            "join_s": stats["join_seconds"], "steps": stats["steps"], "wall_s": wall}


def one_join(model: torch.nn.Module, prompts: list[list[int]], rows: int, first_slot: int, cache_len: int,
             graphs: bool = True, compile: bool = False) -> float:
    """GPU seconds of every prompt joining at once, then one decode step (synchronized)."""
    reqs = [SlotRequest(p, 1, i) for i, p in enumerate(prompts)]
    sync()
    start = time.perf_counter()
    generate_continuous(model, reqs, lambda *a: [], lambda o, t: True, rows=rows, first_slot=first_slot,
                        cache_len=cache_len, graphs=graphs, compile=compile)
    sync()
    return time.perf_counter() - start


def loop_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with the closed loop's arguments (model, clients, prompt lengths, new tokens, seconds)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="llama-2-13b")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--lengths", default="24,90,170,330", help="prompt lengths drawn from, in tokens")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    return parser


def main() -> None:
    parser = loop_arguments(__doc__)
    parser.add_argument("--pack-tokens", default="1024,4096,8192", help="PACK_TOKENS values to time joins with")
    parser.add_argument("--budgets", default="none,2048,1024", help="closed loops' join budgets (prompt tokens)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="last: joins of compiled steps (inductor)")
    parser.add_argument("--join", action="store_true", help="join each layer's projections (as devmap serve does)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model = devmap.load(args.model, "balanced", dtype="bf16")
    if args.join:
        print(f"joined {join_projections(model)} projection groups")
    rows, first_slot = args.clients, -(-(max(lengths) + args.new - 1) // 32) * 32
    cache_len = -(-(first_slot + args.new) // 128) * 128
    rng = random.Random(1)
    prompts = [[rng.randrange(3, min(1000, model.config.vocab_size)) for _ in range(rng.choice(lengths))]
               for _ in range(args.clients)]
    real = sum(len(p) for p in prompts)
    sizes, default = [int(n) for n in args.pack_tokens.split(",")], devmap.generation.joins.PACK_TOKENS
    for label, groups in [("packs", None), *((f"packs of {n} tokens", n) for n in sizes), ("one pack", 1 << 30)]:
        if groups is not None:
            devmap.generation.joins.PACK_TOKENS = groups
            devmap.release_graphs(model)  # the joins' scratch arena is sized by PACK_TOKENS
        times = [one_join(model, prompts, rows, first_slot, cache_len) for _ in range(4)]
        print(f"join of {args.clients} prompts ({real} tokens) as {label}: {[round(t * 1e3, 1) for t in times]} ms",
              flush=True)
        if args.profile and groups is None:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one_join(model, prompts, rows, first_slot, cache_len, graphs=False)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
            from devmap.generation.lane_cache import LaneCache
            take, LaneCache.take_prompts = LaneCache.take_prompts, lambda *a: None
            bare = [one_join(model, prompts, rows, first_slot, cache_len) for _ in range(3)]
            LaneCache.take_prompts = take
            print(f"  without copying keys and values into rows: {[round(t * 1e3, 1) for t in bare]} ms", flush=True)
    devmap.generation.joins.PACK_TOKENS = default  # the closed loops run devmap's own packs
    devmap.release_graphs(model)
    with torch.no_grad():
        ids = torch.randint(3, min(1000, model.config.vocab_size), (args.clients, first_slot),
                            device=next(model.parameters()).device)
        for _ in range(2):
            sync()
            start = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            sync()
        print(f"plain forward of {args.clients} x {first_slot} tokens: {(time.perf_counter() - start) * 1e3:.1f} ms")
    for budget in [None if b == "none" else int(b) for b in args.budgets.split(",")]:
        result = closed_loop(model, args.clients, lengths, args.new, args.seconds, rows, first_slot, cache_len,
                             budget=budget)
        print(f"join budget {budget}:", {k: round(v, 4) for k, v in result.items()}, flush=True)
    if args.compile:
        devmap.release_graphs(model)
        times = [one_join(model, prompts, rows, first_slot, cache_len, compile=True) for _ in range(4)]
        print(f"compiled join: {[round(t * 1e3, 1) for t in times]} ms", flush=True)


if __name__ == "__main__":
    main()
