"""GPU time of one decode step's attention (one query token per row against the cache, with the decode mask):
transformers' sdpa path (its default backend, over every column) against devmap's live-columns kernel
(`devmap.kernels.decode_attention`), and the floor of reading the live columns' keys and values once.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/decode_attention.py [--chunks 64,32,128]
Shapes: 13B (40 heads of 128, no grouping) and 1.1B (32 query heads over 4 KV heads of 64; sdpa gets each KV
head's query heads packed as its queries, as devmap's decode step did before the kernel), at 1, 32 and 64 rows,
caches of 512 and 2048 columns whose rows each hold a live span of a random share (up to `--live`) ending at one
slot; each call captured 100 times in a CUDA graph and replayed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import copy_bandwidth, graph_timed_us  # noqa: E402


def main() -> None:
    import argparse

    from devmap.kernels import decode_attention
    from devmap.kernels.decode_attention import live_columns_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=float, default=0.8, help="the largest share of a row's columns that is live")
    parser.add_argument("--chunks", default=str(decode_attention.CHUNK),
                        help="columns per program to time the kernel with, comma-separated (devmap's CHUNK first)")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]

    def kernel_at(chunk: int, *tensors: torch.Tensor) -> float:
        decode_attention.CHUNK = chunk  # read by the kernel's launch at each call
        try:
            return graph_timed_us(lambda: live_columns_attention(*tensors))
        finally:
            decode_attention.CHUNK = chunks[0]

    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, HBM {bandwidth / 1e12:.2f} TB/s (copy): "
          "microseconds per attention call")
    others = "".join(f" kernel, {c} columns per program |" for c in chunks[1:])
    print(f"| model | rows | columns | live | sdpa | live-columns kernel |{others} floor (live KV once) "
          "| sdpa ÷ kernel |")
    print("|---|---|---|---|---|---|" + "---|" * (len(chunks) - 1) + "---|---|")
    g = torch.Generator().manual_seed(0)
    for name, heads, kv_heads, dim in (("13B", 40, 40, 128), ("1.1B", 32, 4, 64)):
        for rows in (1, 32, 64):
            for length in (512, 2048):
                q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                slot = int(torch.randint(length, (1,), generator=g))
                spans = (torch.rand(rows, generator=g) * args.live * length).long() + 1
                back = (slot - torch.arange(length)) % length
                mask = (back[None, :] < spans[:, None]).cuda()[:, None, None, :]
                packed = q.reshape(rows, kv_heads, heads // kv_heads, dim)
                sdpa_us = graph_timed_us(lambda: sdpa(packed, k, v, attn_mask=mask))
                kernel_us = [kernel_at(chunk, q, k, v, mask) for chunk in chunks]
                live = int(mask.sum())
                floor_us = 2 * live * kv_heads * dim * 2 / bandwidth * 1e6
                timings = " | ".join(f"{us:.1f}" for us in kernel_us)
                print(f"| {name} | {rows} | {length} | {live / (rows * length):.0%} | {sdpa_us:.1f} | "
                      f"{timings} | {floor_us:.1f} | {sdpa_us / kernel_us[0]:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
