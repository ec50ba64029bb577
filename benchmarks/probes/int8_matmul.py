"""GPU time of a decode step's products with int8 weights (one scale per output row, as `--quantize int8` stores
them), against the same products in bf16 and the floor of reading the weights once: torchao's `Int8Tensor` in
eager mode, the same under torch.compile, and devmap's Triton kernel (`devmap.kernels.int8_products`: it reads
the int8 weights and converts them in registers) over 36 block shapes (output columns per program, inner block,
shares of the inner dimension, warps, stages), beside the shape devmap's rule picks. torchao's per-row int8
product is `mm(x, w.to(bf16)) * scale`: eager, the conversion writes a bf16 copy of the weight on every call.

It answers whether an int8 model decodes faster than bf16 at 1-32 rows, and which block shapes the rule should pick.
Past 32 rows (prefills, steps carrying prompts: `--rows 128,512,2048`) devmap quantizes each row to int8 and runs
int8 tensor cores (`int8_products.tokens_product`): the probe times it over TOKEN_CONFIGS (rows × output columns ×
inner block per program, warps, stages) beside devmap's rule, bf16 and torchao's weight-only formula, with each
one's error against the exact int8-weight product (relative norm), and sums a layer's four products.

Run on one GPU:  PYTHONPATH=/tmp/site:. python3 benchmarks/probes/int8_matmul.py [--rows 2,32,64]
Check the kernel on CPU (Triton's interpreter):  TRITON_INTERPRET=1 python3 benchmarks/probes/int8_matmul.py --check
Shapes (`--model`): LLaMA-2-13B's layer (hidden 5120, MLP 13824) or TinyLlama-1.1B's, its query/key/value and
gate/up products joined (as `devmap.generation.joined_projections` runs them). Each call captured 50 times in a
CUDA graph and replayed; at 1-32 rows over copies of the weights that L2 cannot hold at once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import copy_bandwidth, graph_timed_us  # noqa: E402

from devmap.kernels.int8_products import (  # noqa: E402
    DECODE_ROWS,
    BlockShape,
    Int8Weight,
    product,
    kernel_product,
    tokens_product,
    torchao_formula,
)

SHAPES = {  # (out, in) of each product of one layer, query/key/value and gate/up joined
    "llama-2-13b": {"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
    "tinyllama-1.1b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)},
}


# 36 block shapes, each compiled once per row block: ~2 min in all
CONFIGS = ([BlockShape(*c) for c in itertools.product((16, 32, 64, 128), (128, 256, 512), (1,), (4, 8), (3,))]
           + [BlockShape(*c) for c in itertools.product((32, 64), (128, 256), (2, 4, 8), (4,), (3,))])


ROTATED_BYTES = 200_000_000  # at 1-32 rows each product is timed over copies of its weights of at least this size

# 10 tiles (out, inner, splits, warps, stages, rows): rows × outputs × inner per program
TOKEN_CONFIGS = [BlockShape(o, i, 1, w, st, r) for (r, o, i, w, st) in (
    (64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 128, 8, 3), (64, 256, 128, 8, 3),
    (128, 128, 64, 4, 4), (256, 128, 128, 8, 3), (64, 128, 256, 4, 3), (128, 64, 128, 4, 4), (128, 128, 256, 4, 3))]
# `--tile-grid`: 81 small tiles, for 33-64 rows
TILE_GRID = [BlockShape(o, i, 1, 4, st, r) for r, o, i, st in itertools.product((16, 32, 64), (32, 64, 128),
                                                                                (128, 256, 512), (3, 4, 5))]


def tokens_row(name: str, outs: int, ins: int, rows: int, weight: torch.Tensor, qdata: torch.Tensor,
               scale: torch.Tensor, times: dict[str, float], tile_grid: bool) -> tuple[float, float, float]:
    """One row of the table past DECODE_ROWS (tiles: TOKEN_CONFIGS, or TILE_GRID); returns (bf16, torchao's formula,
    devmap's product) µs."""
    x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
    exact = x.float() @ (qdata.float() * scale).t()
    bf16 = graph_timed_us(lambda: torch.nn.functional.linear(x, weight), repeat=20)
    formula = graph_timed_us(lambda: torchao_formula(x, qdata, scale), repeat=20)
    best, best_config = float("inf"), None
    for config in TILE_GRID if tile_grid else TOKEN_CONFIGS:
        try:
            us = graph_timed_us(lambda config=config: tokens_product(x, qdata, scale, config), repeat=20)
        except Exception:  # a tile this GPU cannot hold (shared memory)
            continue
        times[str(tuple(config))] = round(us, 1)
        if us < best:
            best, best_config = us, config
    ours = graph_timed_us(lambda: product(x, Int8Weight(qdata, scale)), repeat=20)

    def error(got: torch.Tensor) -> float:
        return ((got.float() - exact).norm() / exact.norm()).item()

    print(f"| {name} {outs}×{ins} | {rows} | {bf16:.1f} | {formula:.1f} | {best:.1f} {tuple(best_config or ())} "
          f"| {ours:.1f} | {bf16 / ours:.2f}× | {formula / ours:.2f}× "
          f"| {error(product(x, Int8Weight(qdata, scale))):.4f} / "
          f"{error(torchao_formula(x, qdata, scale)):.4f} |", flush=True)
    return bf16, formula, ours


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 (torchao's PerRow int8 weight-only: scale = max |w| / 127)."""
    scale = weight.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return (weight.float() / scale).round().clamp(-128, 127).to(torch.int8), scale


def check() -> None:
    """The kernel against the plain computation, every split, on whatever device torch gives (the interpreter)."""
    torch.manual_seed(0)
    for rows, outs, ins in ((2, 96, 200), (17, 64, 128), (33, 40, 300)):
        x = torch.randn(rows, ins, dtype=torch.float16)
        qdata, scale = quantized(torch.randn(outs, ins))
        want = (x.float() @ qdata.float().t()) * scale.t()
        for splits in (1, 2, 3):
            got = kernel_product(x, qdata, scale, BlockShape(32, 64, splits, 4, 2))
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    x = torch.randn(150, 200, dtype=torch.float16)  # int8 tokens: uneven tiles, a masked inner block
    qdata, scale = quantized(torch.randn(140, 200))
    token_scale = x.float().abs().amax(1, keepdim=True) / 127
    want = ((x.float() / token_scale).round() @ qdata.float().t()) * token_scale * scale.t()
    got = tokens_product(x, qdata, scale, BlockShape(32, 64, 1, 4, 2, rows=32))
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    print("int8 kernel: equal to the plain product")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,32,64")
    parser.add_argument("--model", default="llama-2-13b", choices=sorted(SHAPES), help="whose layer's products")
    parser.add_argument("--check", action="store_true", help="check the kernel (on CPU, under TRITON_INTERPRET=1)")
    parser.add_argument("--no-compile", action="store_true", help="leave out torchao under torch.compile")
    parser.add_argument("--autotune", action="store_true",
                        help="also torchao under torch.compile's max-autotune, whose Triton matmul templates can take "
                             "the int8-to-bf16 conversion into the product (minutes of autotuning)")
    parser.add_argument("--tile-grid", action="store_true", help="past 32 rows: sweep TILE_GRID, not TOKEN_CONFIGS")
    parser.add_argument("--times", default=None, help="write every block shape's time (JSON) here")
    args = parser.parse_args()
    if args.check:
        check()
        return
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig

    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, HBM {bandwidth / 1e12:.2f} TB/s (copy): "
          "microseconds per product")
    every: dict[str, dict[str, float]] = {}
    granularity = Int8WeightOnlyConfig().granularity
    weights = {}  # each product's bf16 weight and its int8 data and scales, made once for both tables
    for name, (outs, ins) in SHAPES[args.model].items():
        weight = torch.randn(outs, ins, device="cuda", dtype=torch.bfloat16) / ins ** 0.5
        weights[name] = (weight, *quantized(weight))
    token_rows = [int(r) for r in args.rows.split(",") if int(r) > DECODE_ROWS]
    if token_rows:
        print("| product | rows | bf16 | torchao's formula | int8 tokens (best tile) | devmap's int8 product "
              "| bf16 ÷ devmap | formula ÷ devmap | error: devmap / formula |\n|---|---|---|---|---|---|---|---|---|")
    for rows in token_rows:
        layer = [0.0] * 3
        for name, (outs, ins) in SHAPES[args.model].items():
            times = tokens_row(name, outs, ins, rows, *weights[name], every.setdefault(f"{name} {rows}", {}),
                               args.tile_grid)
            layer = [a + b for a, b in zip(layer, times)]
        print(f"a layer's four products at {rows} rows: bf16 {layer[0]:.0f} µs, torchao's formula {layer[1]:.0f}, "
              f"devmap {layer[2]:.0f} ({layer[0] / layer[2]:.2f}× / {layer[1] / layer[2]:.2f}×)", flush=True)
    decode_rows = [int(r) for r in args.rows.split(",") if int(r) <= DECODE_ROWS]
    if not decode_rows:
        if args.times:
            Path(args.times).write_text(json.dumps(every, indent=1))
        return
    print("| product | rows | bf16 | bf16 floor | torchao int8 eager | torchao int8 compiled "
          "| torchao int8 max-autotune | Triton int8 (best config) | Triton int8, no split (best) "
          "| devmap's int8 product | int8 floor | bf16 ÷ best int8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (outs, ins) in SHAPES[args.model].items():
        weight, qdata, scale = weights[name]
        torchao_weight = Int8Tensor.from_hp(weight, granularity)
        compiled = None if args.no_compile else torch.compile(lambda x: torch.nn.functional.linear(x, torchao_weight))
        tuned = (torch.compile(lambda x: torch.nn.functional.linear(x, torchao_weight),
                               mode="max-autotune-no-cudagraphs") if args.autotune else None)
        # copies to cycle through, so that no product finds its weight in L2 (50 MB: o's int8 weight would fit)
        copies = [(qdata, scale)] + [(qdata.clone(), scale.clone()) for _ in range(ROTATED_BYTES // qdata.numel())]
        bf16_copies = [weight] + [weight.clone() for _ in range(ROTATED_BYTES // (2 * weight.numel()))]
        for rows in decode_rows:
            x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
            next_bf16, next_int8 = itertools.cycle(bf16_copies).__next__, itertools.cycle(copies).__next__
            bf16 = graph_timed_us(lambda: torch.nn.functional.linear(x, next_bf16()), repeat=50)
            eager = graph_timed_us(lambda: torch.nn.functional.linear(x, torchao_weight), repeat=50)
            compiled_us = graph_timed_us(lambda: compiled(x), repeat=50) if compiled is not None else float("nan")
            tuned_us = graph_timed_us(lambda: tuned(x), repeat=50) if tuned is not None else float("nan")
            want = torch.nn.functional.linear(x, weight).float()
            best, best_config = float("inf"), None
            unsplit, unsplit_config = float("inf"), None
            times = every.setdefault(f"{name} {rows}", {})
            for config in CONFIGS:
                try:
                    got = kernel_product(x, qdata, scale, config)
                except Exception:  # a block shape this GPU cannot hold (shared memory)
                    continue
                if (got.float() - want).abs().max() > 0.05 * want.abs().max():
                    raise AssertionError(f"{name} {rows} {config}: the kernel's product is wrong")
                us = graph_timed_us(lambda config=config: kernel_product(x, *next_int8(), config), repeat=50)
                times[str(tuple(config))] = round(us, 1)
                if us < best:
                    best, best_config = us, config
                if config.splits == 1 and us < unsplit:
                    unsplit, unsplit_config = us, config
            ours = graph_timed_us(lambda: product(x, Int8Weight(*next_int8())), repeat=50)
            bf16_floor = outs * ins * 2 / bandwidth * 1e6
            int8_floor = outs * ins / bandwidth * 1e6
            fastest = min(us for us in (eager, compiled_us, tuned_us, best, ours) if us == us)  # NaN: not run
            print(f"| {name} {outs}×{ins} | {rows} | {bf16:.1f} | {bf16_floor:.1f} | {eager:.1f} | {compiled_us:.1f} "
                  f"| {tuned_us:.1f} | {best:.1f} {tuple(best_config)} | {unsplit:.1f} {tuple(unsplit_config)} "
                  f"| {ours:.1f} | {int8_floor:.1f} | {bf16 / fastest:.2f}× |", flush=True)
    if args.times:
        Path(args.times).write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
