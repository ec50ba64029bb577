"""A decode step's products by the tokens they carry: cuBLAS bf16 time of LLaMA-2-13B's four products of a layer at
32 rows and at 32 rows plus a pack of prompt tokens, against reading their weights at the copy bandwidth.

Run on a GPU machine:  PYTHONPATH=. python3 benchmarks/probes/product_rows.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth  # noqa: E402

SHAPES = {"qkv": (5120, 15360), "out": (5120, 5120), "gate_up": (5120, 27648), "down": (13824, 5120)}


def product_ms(rows: int, inner: int, outer: int) -> float:
    x = torch.randn(rows, inner, dtype=torch.bfloat16, device="cuda")
    weights = [torch.randn(outer, inner, dtype=torch.bfloat16, device="cuda") for _ in range(8)]  # past the L2
    for w in weights:
        torch.nn.functional.linear(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        for w in weights:
            torch.nn.functional.linear(x, w)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 40


def main() -> None:
    bandwidth = copy_bandwidth()
    read = sum(2 * i * o for i, o in SHAPES.values()) / bandwidth * 1e3
    print(f"HBM {bandwidth / 1e12:.2f} TB/s: a layer's weights read in {read:.3f} ms")
    for rows in (32, 64, 96, 128, 160, 192, 288, 416, 544):
        times = {name: product_ms(rows, *shape) for name, shape in SHAPES.items()}
        total = sum(times.values())
        print(f"{rows:4d} rows: " + ", ".join(f"{n} {t * 1e3:.0f} us" for n, t in times.items())
              + f"; layer {total:.3f} ms = {read / total:.0%} of the weight-read pace, x40 layers {40 * total:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
