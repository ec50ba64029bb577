"""GPU time of one decode step's attention (one query token per row against the cache, with the decode mask), per
SDPA backend: which kernel a decode step should ask for.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/decode_attention.py
Shapes: 13B (40 heads of 128, no grouping) and 1.1B grouped (4 KV heads, their 8 query heads each as queries, 64),
at 8 and 32 rows and cache lengths of 512 and 2048; each call captured 100 times in a CUDA graph and replayed.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def timed(call, repeat: int = 100) -> float:
    call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 5 / repeat * 1000  # microseconds per call


def main() -> None:
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: microseconds per attention call")
    for name, heads, queries, dim in (("13B", 40, 1, 128), ("1.1B grouped", 4, 8, 64)):
        for rows in (8, 32):
            for length in (512, 2048):
                q = torch.randn(rows, heads, queries, dim, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(rows, heads, length, dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                mask = torch.rand(rows, 1, 1, length, device="cuda") < 0.3
                mask[..., 0] = True
                cells = []
                for label, backend in BACKENDS.items():
                    def call(backend=backend) -> None:
                        if backend is None:
                            sdpa(q, k, v, attn_mask=mask)
                        else:
                            with sdpa_kernel(backend):
                                sdpa(q, k, v, attn_mask=mask)
                    try:
                        cells.append(f"{label} {timed(call):6.1f}")
                    except Exception as exc:
                        cells.append(f"{label} n/a ({str(exc).splitlines()[0][:40]})")
                kv_bytes = 2 * k.numel() * 2
                floor = kv_bytes / 4.2e12 * 1e6
                print(f"  {name:13s} rows {rows:2d} cache {length:4d}: " + ", ".join(cells) +
                      f"; KV read floor {floor:.1f}", flush=True)


if __name__ == "__main__":
    main()
