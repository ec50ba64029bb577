"""How long torch's scaled_dot_product_attention takes the first time it meets a pack width, and after: the
attention of a step that carries a pack of prompts (one row of W prompt tokens against its W cache columns, a
boolean causal mask) at LLaMA-2-13B's heads, under each SDPA backend torch may pick, each backend in a fresh process
(what a process caches for one width, a plan or a loaded kernel, stays out of the others' figures).

An eager step meets a new width at every new pack a wave of joiners makes; a backend that builds something per
shape on its first call stalls that step by its building time, while every stream of the batch waits for it.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/sdpa_first_call.py [--widths 48,96,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

BACKENDS = ("default", "cudnn", "efficient", "math")
HEADS, DIM = 40, 128  # LLaMA-2-13B


def _timed(width: int, steady_runs: int) -> tuple[float, float]:
    """First-call and median steady milliseconds of one width's attention (under whatever backend is in force)."""
    query, key, value = (torch.randn(1, HEADS, width, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(width, width, device="cuda", dtype=torch.bool).tril()[None, None]
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    torch.cuda.synchronize()
    first = (time.perf_counter() - started) * 1e3
    times = []
    for _ in range(steady_runs):
        started = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return first, sorted(times)[len(times) // 2]


def one_backend(backend: str, widths: list[int]) -> dict[int, tuple[float, float]]:
    """Every width's first and steady milliseconds under `backend` (this process's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.ones(1, device="cuda")  # the CUDA context, out of the first width's figure
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "math": SDPBackend.MATH}.get(backend)
    results = {}
    for width in widths:
        if chosen is None:
            results[width] = _timed(width, 20)
        else:
            with sdpa_kernel([chosen]):
                results[width] = _timed(width, 20)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="48,96,160,336,512,1000,2048")
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # one backend, in the process the table starts
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.backend:
        print(json.dumps(one_backend(args.backend, widths)))
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms, first call / steady (median of 20)")
    print("| width | " + " | ".join(BACKENDS) + " |")
    print("|---|" + "---|" * len(BACKENDS))
    table: dict[str, dict[str, list[float]]] = {}
    for backend in BACKENDS:
        done = subprocess.run([sys.executable, __file__, "--widths", args.widths, "--backend", backend],
                              capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        table[backend] = json.loads(lines[-1]) if done.returncode == 0 and lines else {}
        if done.returncode != 0:
            print(f"{backend}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    for width in widths:
        cells = [f"{table[b][str(width)][0]:.1f} / {table[b][str(width)][1]:.2f}" if str(width) in table[b] else "–"
                 for b in BACKENDS]
        print(f"| {width} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
