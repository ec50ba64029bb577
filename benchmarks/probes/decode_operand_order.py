"""Whether devmap's int8 and fp8 decode kernels would gain from two changes the 4-bit kernel made: the weights as the
first operand of each product (the tensor cores then read them from registers; as the second they go through shared
memory), and int8 weights widened by PTX (four bytes to four bfloat16 values through float32 bit patterns, exactly).
Each variant is timed over a block-shape grid at 1 and 32 rows on LLaMA-2-13B's four products, beside the kernels as
they are (`int8_products.kernel_product`, `fp8_products.kernel_product`, their own rule's block shape); split-K sums
included. docs/kernels.md has the table: neither change gains (Triton already widens int8 with byte permutes and
bf16 subtracts, and with the weights first it issues Hopper's wgmma at 64 rows of weights a block).

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/decode_operand_order.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import copy_bandwidth, graph_timed_us  # noqa: E402

from fp8_matmul import L2_OVER, SHAPES  # noqa: E402  (LLaMA-2-13B's products; this probe's folder)

from devmap.kernels.fp8_products import kernel_product as fp8_now  # noqa: E402
from devmap.kernels.int8_products import BlockShape, block_shape  # noqa: E402
from devmap.kernels.int8_products import kernel_product as int8_now  # noqa: E402
from devmap.kernels.split_k import add_partial_sums, partial_sums  # noqa: E402

# one 32-bit word of four int8 weights in, their four bfloat16 values out ($0-$3): each byte's sign flipped (+128) is
# the low byte of the float32 2**23 + u, less 2**23 + 128 the weight exactly, whose upper half is its bfloat16
BF16_PTX = """{
.reg .b32 flipped, magic, f0, f1, f2, f3;
.reg .b16 low;
xor.b32 flipped, $4, 0x80808080;
mov.b32 magic, 0x4B000000;
prmt.b32 f0, flipped, magic, 0x7540;
prmt.b32 f1, flipped, magic, 0x7541;
prmt.b32 f2, flipped, magic, 0x7542;
prmt.b32 f3, flipped, magic, 0x7543;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
mov.b32 {low, $0}, f0;
mov.b32 {low, $1}, f1;
mov.b32 {low, $2}, f2;
mov.b32 {low, $3}, f3;
}"""

@triton.jit
def _widened_words(W, out, outs, word, keep_in, w_row, PTX: tl.constexpr):
    """The four weights of each 32-bit word of W's rows `out` at `word` (uint16 bit patterns), widened by PTX."""
    words = W.to(tl.pointer_type(tl.uint32))
    packed = tl.load(words + out[:, None] * (w_row // 4) + word[None, :],
                     mask=(out[:, None] < outs) & keep_in[None, :], other=0)
    return tl.inline_asm_elementwise(PTX, "=h,=h,=h,=h,r", [packed],
                                     dtype=(tl.uint16, tl.uint16, tl.uint16, tl.uint16), is_pure=True, pack=1)


@triton.jit
def int8_w(X, W, Scale, Out, rows, outs, ins, x_row, w_row, out_row, out_split,
           BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, SPLIT: tl.constexpr,
           PTX: tl.constexpr, USE_PTX: tl.constexpr):
    """The int8 decode product with the weights first (acc: outputs × rows), widened by PTX with USE_PTX (each
    word's four weights meet the inputs 4k, 4k+1, 4k+2, 4k+3 in four products), else by Triton."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    keep_rows = row[None, :] < rows
    keep_outs = out[:, None] < outs
    acc = tl.zeros((BLOCK_OUT, BLOCK_ROWS), dtype=tl.float32)
    if USE_PTX:
        QUARTER: tl.constexpr = BLOCK_IN // 4
        k = tl.arange(0, QUARTER)
        for start in range(split * BLOCK_IN, ins, BLOCK_IN * SPLIT):
            word = start // 4 + k
            keep_in = word < ins // 4
            w0, w1, w2, w3 = _widened_words(W, out, outs, word, keep_in, w_row, PTX)
            xs = X + row[None, :] * x_row + 4 * word[:, None]
            m = keep_rows & keep_in[:, None]
            dt: tl.constexpr = X.dtype.element_ty
            acc += tl.dot(w0.to(dt, bitcast=True), tl.load(xs, mask=m, other=0.0))
            acc += tl.dot(w1.to(dt, bitcast=True), tl.load(xs + 1, mask=m, other=0.0))
            acc += tl.dot(w2.to(dt, bitcast=True), tl.load(xs + 2, mask=m, other=0.0))
            acc += tl.dot(w3.to(dt, bitcast=True), tl.load(xs + 3, mask=m, other=0.0))
    else:
        for start in range(split * BLOCK_IN, ins, BLOCK_IN * SPLIT):
            inner = start + tl.arange(0, BLOCK_IN)
            x = tl.load(X + row[None, :] * x_row + inner[:, None], mask=keep_rows & (inner[:, None] < ins), other=0.0)
            w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=keep_outs & (inner[None, :] < ins), other=0)
            acc += tl.dot(w.to(x.dtype), x)
    acc = acc * tl.load(Scale + out, mask=out < outs, other=0.0)[:, None]
    tl.store(Out + split * out_split + row[None, :] * out_row + out[:, None], acc.to(Out.dtype.element_ty),
             mask=keep_rows & keep_outs)

@triton.jit
def int8_x_ptx(X, W, Scale, Out, rows, outs, ins, x_row, w_row, out_row, out_split,
               BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, SPLIT: tl.constexpr,
               PTX: tl.constexpr):
    """The int8 decode product as it is (the inputs first), its weights widened by PTX."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    QUARTER: tl.constexpr = BLOCK_IN // 4
    k = tl.arange(0, QUARTER)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    dt: tl.constexpr = X.dtype.element_ty
    for start in range(split * BLOCK_IN, ins, BLOCK_IN * SPLIT):
        word = start // 4 + k
        keep_in = word < ins // 4
        w0, w1, w2, w3 = _widened_words(W, out, outs, word, keep_in, w_row, PTX)
        xs = X + row[:, None] * x_row + 4 * word[None, :]
        m = (row[:, None] < rows) & keep_in[None, :]
        acc += tl.dot(tl.load(xs, mask=m, other=0.0), tl.trans(w0.to(dt, bitcast=True)))
        acc += tl.dot(tl.load(xs + 1, mask=m, other=0.0), tl.trans(w1.to(dt, bitcast=True)))
        acc += tl.dot(tl.load(xs + 2, mask=m, other=0.0), tl.trans(w2.to(dt, bitcast=True)))
        acc += tl.dot(tl.load(xs + 3, mask=m, other=0.0), tl.trans(w3.to(dt, bitcast=True)))
    acc = acc * tl.load(Scale + out, mask=out < outs, other=0.0)[None, :]
    tl.store(Out + split * out_split + row[:, None] * out_row + out[None, :], acc.to(Out.dtype.element_ty),
             mask=(row[:, None] < rows) & (out[None, :] < outs))

@triton.jit
def fp8_w(X, XScale, W, WScale, Out, rows, outs, ins, x_row, w_row, out_row, out_split,
          BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, SPLIT: tl.constexpr):
    """The fp8 decode product with the weights first (acc: outputs × rows)."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    keep_rows = row[None, :] < rows
    keep_outs = out[:, None] < outs
    acc = tl.zeros((BLOCK_OUT, BLOCK_ROWS), dtype=tl.float32)
    for start in range(split * BLOCK_IN, ins, BLOCK_IN * SPLIT):
        inner = start + tl.arange(0, BLOCK_IN)
        x = tl.load(X + row[None, :] * x_row + inner[:, None], mask=keep_rows & (inner[:, None] < ins), other=0.0)
        w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=keep_outs & (inner[None, :] < ins), other=0.0)
        acc += tl.dot(w.to(tl.float16), x.to(tl.float16))
    acc = acc * tl.load(XScale + row, mask=row < rows, other=0.0)[None, :]
    acc = acc * tl.load(WScale + out, mask=out < outs, other=0.0)[:, None]
    tl.store(Out + split * out_split + row[None, :] * out_row + out[:, None], acc.to(Out.dtype.element_ty),
             mask=keep_rows & keep_outs)

def launched(kernel, inputs: tuple, qdata, out_dtype, shape: BlockShape, **constants) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One variant's product: `kernel` over `inputs` (the rows, then their scales for fp8) and `qdata` (+ the
    weight's scales, last of `inputs`), cut as `shape` says, its split-K parts summed."""
    rows, ins = inputs[0].shape
    outs = qdata.shape[0]
    out = torch.empty((rows, outs), dtype=out_dtype, device=qdata.device)
    parts = partial_sums(out, shape.splits)
    *tokens, scale = inputs
    kernel[(triton.cdiv(outs, shape.out), shape.splits)](
        *tokens, qdata, scale, parts, rows, outs, ins, inputs[0].stride(0), qdata.stride(0), outs, rows * outs,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=shape.out, BLOCK_IN=shape.inner,
        SPLIT=shape.splits, num_warps=shape.warps, num_stages=shape.stages, **constants)
    add_partial_sums(parts, out, shape.splits)
    return out


WIDE = [BlockShape(o, i, 1, 4, st) for o, i, st in itertools.product((64, 128), (256, 512), (3, 4))]
NARROW = [BlockShape(o, i, sp, 4, 3) for o, i, sp in itertools.product((32, 64), (128, 256), (4, 8))]


def main() -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"HBM {bandwidth / 1e12:.2f} TB/s", flush=True)
    totals: dict[tuple[str, int], float] = {}
    for name, (outs, ins) in SHAPES.items():
        count = max(1, min(8, -(-L2_OVER // (outs * ins))))
        qdata = [torch.randint(-128, 128, (outs, ins), dtype=torch.int8, device="cuda") for _ in range(count)]
        scale = [torch.rand(outs, 1, device="cuda") + 0.5 for _ in range(count)]
        fp8 = [(torch.randn(outs, ins, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
               for _ in range(count)]
        floor = (outs * ins + 4 * outs) / bandwidth * 1e6
        for rows in (1, 32):
            x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
            tokens = (torch.randn(rows, ins, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
            token_scales = torch.rand(rows, 1, device="cuda") + 0.5
            turn = [0]

            def rotating(call):  # type: ignore[no-untyped-def]
                def next_copy() -> None:
                    call(turn[0] % count)
                    turn[0] += 1
                return next_copy

            variants = {
                "int8 weights first, PTX": lambda shape: lambda i: launched(
                    int8_w, (x, scale[i]), qdata[i], x.dtype, shape, PTX=BF16_PTX, USE_PTX=True),
                "int8 weights first": lambda shape: lambda i: launched(
                    int8_w, (x, scale[i]), qdata[i], x.dtype, shape, PTX="", USE_PTX=False),
                "int8 PTX": lambda shape: lambda i: launched(int8_x_ptx, (x, scale[i]), qdata[i], x.dtype, shape,
                                                             PTX=BF16_PTX),
                "fp8 weights first": lambda shape: lambda i: launched(fp8_w, (tokens, token_scales, scale[i]), fp8[i],
                                                                      torch.bfloat16, shape),
            }
            want = int8_now(x, qdata[0], scale[0])
            for label in ("int8 weights first, PTX", "int8 weights first", "int8 PTX"):
                got = variants[label](block_shape(rows, outs))(0)
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the same sums, in another order
            times = {"int8 as it is": graph_timed_us(rotating(lambda i: int8_now(x, qdata[i], scale[i])), 8 * count),
                     "fp8 as it is": graph_timed_us(rotating(
                         lambda i: fp8_now(tokens, token_scales, fp8[i], scale[i])), 8 * count)}
            for label, make in variants.items():
                best = float("inf")
                for shape in [block_shape(rows, outs)] + (WIDE if outs >= 8192 else NARROW):
                    try:
                        best = min(best, graph_timed_us(rotating(make(shape)), 8 * count))
                    except Exception:  # noqa: BLE001 - a block shape this card cannot hold
                        continue
                times[label] = best
            print(f"{name} {outs}×{ins}, {rows} rows, floor {floor:.1f} µs: "
                  + "; ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
            for label, us in times.items():
                totals[(label, rows)] = totals.get((label, rows), 0.0) + us
    print("| variant | µs a 13B layer, 1 row | 32 rows |\n|---|---|---|")
    for label in dict.fromkeys(label for label, _ in totals):
        print(f"| {label} | {totals[(label, 1)]:.1f} | {totals[(label, 32)]:.1f} |")


if __name__ == "__main__":
    main()
