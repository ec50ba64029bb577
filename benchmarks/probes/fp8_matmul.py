"""GPU time of a decode step's products with float8 weights and tokens (a scale per output row and per token, as
`--quantize fp8` stores and torchao quantizes them): devmap's kernel (`devmap.kernels.fp8_products.kernel_product`,
cut as the int8 decode kernel) against `torch._scaled_mm` with fast accumulation (what torchao's float8 Linear
calls), on the same float8 tokens and weights, beside the floor of reading the weights once. The tokens' quantization
is left out of both: served steps fuse it into the operation before the product, whichever product follows.

It answers up to how many rows devmap's kernel should run (`fp8_products.DECODE_ROWS`).

Run on one GPU:  PYTHONPATH=/tmp/site:. python3 benchmarks/probes/fp8_matmul.py [--rows 1,4,8,16,24,32]
Shapes: LLaMA-2-13B's layer, its query/key/value and gate/up products joined. Each product captured in a CUDA graph
over copies of its weight that the L2 cannot hold at once (`common.graph_timed_us`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, graph_timed_us  # noqa: E402

SHAPES = {"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)}
L2_OVER = 4 * 2**30 // 32  # copies of a weight until they hold at least this many bytes


def float8(*shape: int, spread: float) -> torch.Tensor:
    """Normal values times `spread`, within float8's range, as float8 (e4m3) on the GPU."""
    return (torch.randn(*shape, device="cuda") * spread).clamp(-448, 448).to(torch.float8_e4m3fn)


def main() -> None:
    from devmap.kernels.fp8_products import kernel_product

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,24,32")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; HBM {bandwidth / 1e12:.2f} TB/s")
    print("| product | rows | devmap's kernel µs | torch._scaled_mm µs | its time ÷ devmap's | floor µs |")
    print("|---|---|---|---|---|---|")
    for name, (outs, ins) in SHAPES.items():
        count = max(1, min(8, -(-L2_OVER // (outs * ins))))
        weights = [(float8(outs, ins, spread=100), torch.rand(outs, 1, device="cuda") + 0.5) for _ in range(count)]
        for rows in (int(r) for r in args.rows.split(",")):
            tokens, scales = float8(rows, ins, spread=50), torch.rand(rows, 1, device="cuda") + 0.5
            turn = [0]

            def ours() -> None:
                qdata, scale = weights[turn[0] % count]
                turn[0] += 1
                kernel_product(tokens, scales, qdata, scale)

            def theirs() -> None:
                qdata, scale = weights[turn[0] % count]
                turn[0] += 1
                torch._scaled_mm(tokens, qdata.t(), scale_a=scales, scale_b=scale.t(), out_dtype=torch.bfloat16,
                                 use_fast_accum=True)

            mine, library = graph_timed_us(ours, 8 * count), graph_timed_us(theirs, 8 * count)
            floor = (outs * ins + 4 * outs) / bandwidth * 1e6
            print(f"| {name} | {rows} | {mine:.1f} | {library:.1f} | {library / mine:.2f}× | {floor:.1f} |", flush=True)


if __name__ == "__main__":
    main()
