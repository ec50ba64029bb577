"""GPU time of a LLaMA-2-13B layer's four products with 4-bit weights, against bf16 and the floor of reading the weights
once: the libraries' kernels (torchao's int4 in tinygemm's layout, bitsandbytes' nf4: what `--quantize int4|nf4` ran
before devmap read the weights itself) and devmap's 4-bit products (`devmap.kernels.four_bit_products`, int4's code
values or nf4's table): its rows kernel at the rule's block shape (up to TILED_ROWS rows), the dequantize kernel +
cuBLAS, what `product` picks (on an sm_90 GPU, Hopper's kernel at 33-256 rows), and, with `--grid`, the best
over a grid of shapes (the rows kernel's output columns, split-K parts, warps, stages; Hopper's tiles, output columns,
stages, split-K parts). Also checks that devmap's layout, taken from the library's weights, gives its products
(relative error printed).

Run on one GPU:  PYTHONPATH=/tmp/site:. python3 benchmarks/probes/four_bit_matmul.py [--rows 1,32,64,256,2048] [--grid]
Shapes: query/key/value and gate/up joined. Each call captured 50 times in a CUDA graph and replayed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, graph_timed_us  # noqa: E402

from devmap.kernels.card import card  # noqa: E402
from devmap.kernels.four_bit_linear import four_bit_weight  # noqa: E402
from devmap.kernels.four_bit_products import (  # noqa: E402
    DECODE_ROWS, TILED_ROWS, BlockShape, block_shape, four_bit_rows_product, kernel_product, dequantized,
    wgmma_decode_ptx)

SHAPES = {"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)}


def library_linear(weight: torch.Tensor, scheme: str) -> torch.nn.Module:
    """The Linear as devmap's loader quantizes it with the scheme's library."""
    from devmap.loading.quantize import quantize_linears
    from devmap.planning.quantization import parse_quantization

    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda", dtype=weight.dtype)
    holder.linear.weight.data.copy_(weight)
    quantize_linears(holder, ["linear"], parse_quantization(scheme))
    return holder.linear


def grid(rows: int, outs: int, spans: int) -> list[BlockShape]:
    """Shapes to time: every row in one block up to 32 rows (output columns, shares, warps, stages); beyond, every row
    in one block or tiles of 64 or 128 rows (output columns, warps; the rule's shares for one block, one share for
    tiles)."""
    if rows <= 32:
        return [BlockShape(out, max(1, min(spans, share * block_shape(rows, outs * 256 // out, spans).splits)),
                           warps, stages)
                for out, share, warps, stages in itertools.product((64, 128, 256), (1, 2), (4, 8), (2, 3, 4))]
    programs = card(torch.device("cuda")).programs
    return [BlockShape(out, max(1, min(spans, programs // -(-outs // out))) if height == 0 else 1, warps, 3, height)
            for height, out, warps in itertools.product((0, 64, 128), (64, 128, 256), (4, 8))]


def wgmma_grid(rows: int, outs: int, spans: int, span: int, table: bool) -> list:
    """Hopper's kernel's shapes to time: the rule's tile (in its parts) and the power of two that holds the rows,
    64 or 128 output columns, 2-4 stages that fit, one share or the count that makes the card's programs."""
    from devmap.kernels.four_bit_products_wgmma import WgmmaShape, stage_bytes, wgmma_shape

    gpu = card(torch.device("cuda"))
    rule = wgmma_shape(rows, outs, spans, span, table, gpu)
    shapes = {rule}
    tiles = {(rule.rows, rule.tail), (min(256, max(64, 1 << (rows - 1).bit_length())), 0)}
    for (tile, tail), out, stages in itertools.product(tiles, (64, 128), (2, 3, 4)):
        if stages * stage_bytes(tile, out, span) <= gpu.ring_bytes:
            programs = -(-outs // out) * -(-rows // tile)
            for splits in {1, max(1, min(spans, gpu.programs // programs))}:
                shapes.add(WgmmaShape(tile, out, stages, splits, tail))
    return sorted(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,64,128,256,512,2048")
    parser.add_argument("--schemes", default="int4", help="int4 and/or nf4")
    parser.add_argument("--grid", action="store_true", help="time a grid of block shapes beside the rule's")
    parser.add_argument("--no-library", action="store_true", help="leave out the library's product (slow at many rows)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"HBM {bandwidth / 1e12:.2f} TB/s (copy); torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| scheme | product | rows | bf16 µs | library µs | devmap µs | rows kernel µs | values + mm µs | best µs | "
          "best shape | floor µs | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[str, float] = {}
    for scheme in args.schemes.split(","):
        for name, (outs, ins) in SHAPES.items():
            torch.manual_seed(0)
            weight = torch.randn(outs, ins, device="cuda", dtype=torch.bfloat16) * 0.02
            linear = library_linear(weight, scheme)
            ours = four_bit_weight(linear)
            nbytes = (sum(t.numel() * t.element_size() for t in ours.tensors if t is not None) if ours
                      else weight.numel() // 2)
            floor = nbytes / bandwidth * 1e6
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
                bf16 = graph_timed_us(lambda: torch.nn.functional.linear(x, weight), repeat=50)
                library = float("nan") if args.no_library else graph_timed_us(lambda: linear(x), repeat=50)
                if ours is None:
                    print(f"| {scheme} | {name} | {rows} | {bf16:.1f} | {library:.1f} | | | | | | {floor:.1f} | |")
                    continue
                with torch.no_grad():
                    got = four_bit_rows_product(x, *ours.tensors, list(ours.code_values)).float()
                    want = linear(x).float()
                error = ((got - want).norm() / want.norm()).item()
                rule = graph_timed_us(lambda: four_bit_rows_product(x, *ours.tensors, list(ours.code_values)),
                                      repeat=50)
                kernel = graph_timed_us(lambda: kernel_product(x, ours), repeat=50) if rows <= TILED_ROWS \
                    else float("nan")
                dense = graph_timed_us(lambda: torch.mm(x, dequantized(ours, x.dtype).t()), repeat=50)
                best, best_shape = kernel, "rule"
                if args.grid and rows <= 512:
                    for shape in grid(rows, outs, ins // ours.span):
                        try:
                            us = graph_timed_us(lambda shape=shape: kernel_product(x, ours, shape), repeat=50)
                        except Exception as exc:  # noqa: BLE001 - a probe: a shape too large for the SM, say so
                            print(f"{shape}: {type(exc).__name__}")
                            continue
                        if us < best:
                            best, best_shape = us, str(tuple(shape))
                    ptx = wgmma_decode_ptx(x, ours) if DECODE_ROWS < rows <= TILED_ROWS else ""
                    if ptx:
                        from devmap.kernels.four_bit_products_wgmma import wgmma_product

                        for shape in wgmma_grid(rows, outs, ins // ours.span, ours.span, not ours.affine):
                            us = graph_timed_us(lambda shape=shape: wgmma_product(x, ours, ptx, shape),
                                                repeat=50)
                            if us < best:
                                best, best_shape = us, f"Hopper {tuple(shape)}"
                for key, value in (("bf16", bf16), ("library", library), ("devmap", rule), ("rows kernel", kernel),
                                   ("best", best)):
                    totals[f"{scheme} {key} {rows}"] = totals.get(f"{scheme} {key} {rows}", 0.0) + value
                print(f"| {scheme} | {name} | {rows} | {bf16:.1f} | {library:.1f} | {rule:.1f} | {kernel:.1f} | "
                      f"{dense:.1f} | {best:.1f} | {best_shape} | {floor:.1f} | {error:.4f} |", flush=True)
            linear = ours = None
            torch.cuda.empty_cache()
    print("one 13B layer's four products, µs (×40 for a step):")
    for key, value in totals.items():
        print(f"  {key}: {value:.1f}")


if __name__ == "__main__":
    main()
