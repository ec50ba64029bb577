"""The Triton kernels behind `fp8_products` at decode rows (imported only where they run: Triton comes with torch's
CUDA wheels): one program per block of output columns and split-K part of the inner dimension (`split_k` adds the
parts), as the int8 decode kernel cuts its products. Tokens and weights are float8 (e4m3) with a scale per row; both
are widened to float16, which holds every e4m3 value exactly, so each product of two of them is exact and the sums
are float32, as `torch._scaled_mm`'s. The gated kernel makes a feed-forward's gate and up halves in one program and
gates them (`gated_kernel`), leaving row maxima from which one more kernel makes the down product's float8 tokens
as torchao's formula makes them."""

from __future__ import annotations

import triton
import triton.language as tl

from .gated_kernel import gated_epilogue

FLOAT8_MAX = tl.constexpr(448.0)  # e4m3's largest value


@triton.jit
def _rounded_to_bfloat16(v):
    """v (float32, finite) rounded to bfloat16, ties to even, as a float32: the low 16 bits rounded away in integer
    arithmetic. For Triton's interpreter, whose bfloat16 conversion truncates."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rounded_to_e4m3(v):
    """v (float32, |v| ≤ 448) rounded to the nearest e4m3 value, ties to even, in float32 arithmetic: its quantum is
    2^(exponent - 3) (2^-9 below e4m3's smallest normal, 2^-6), and adding then taking away 1.5 · 2^(quantum's
    exponent + 23) rounds to it (torch's conversion's value on every e4m3 value and midpoint). For Triton's
    interpreter, whose float8 conversion drops the carry of a rounding (31.5 becomes 16); a GPU's conversion
    rounds in one instruction."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = tl.maximum(exponent, -6) - 3
    magic = ((quantum + 150) << 23 | 0x400000).to(tl.float32, bitcast=True)
    rounded = (v + magic) - magic
    return tl.where(rounded == 0.0, v * 0.0, rounded)  # keeps the sign of a value rounded to zero


@triton.jit
def fp8_tokens_from_maxes_kernel(X, Maxes, Q, Scales, rows, size, parts, x_row, BLOCK: tl.constexpr,
                                 BLOCK_PARTS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Q[r, block] = X[r, block] / Scales[r] in float8 (clamped to e4m3's range, rounded to nearest, ties to even;
    program (r, b): row r, columns b·BLOCK …), Scales[r] = max |X[r]| / 448 in bfloat16 (then float32) from a gated
    product's row maxima (Maxes: parts × rows), torchao's formula with correctly rounded divisions, as torch's.
    ROUND_FIRST (Triton's interpreter, whose half-precision and float8 conversions do not round to nearest): each
    rounding done in arithmetic first."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    most = tl.zeros((BLOCK_PARTS,), dtype=tl.float32)
    for start in range(0, parts, BLOCK_PARTS):
        part = start + tl.arange(0, BLOCK_PARTS)
        most = tl.maximum(most, tl.load(Maxes + part * rows + row, mask=part < parts, other=0.0))
    scale = tl.math.div_rn(tl.max(most, axis=0), FLOAT8_MAX)
    if ROUND_FIRST:
        scale = _rounded_to_bfloat16(scale)
    else:
        scale = scale.to(tl.bfloat16).to(tl.float32)
    col = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * x_row + col, mask=col < size, other=0.0).to(tl.float32)
    v = tl.clamp(tl.math.div_rn(x, tl.full((BLOCK,), 1.0, tl.float32) * scale), -FLOAT8_MAX, FLOAT8_MAX)
    if ROUND_FIRST:
        v = _rounded_to_e4m3(v)
    tl.store(Q + row * size + col, v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=col < size)
    if block == 0:
        tl.store(Scales + row, scale)


@triton.jit
def fp8_rows_kernel(X, XScale, W, WScale, Out, rows, outs, ins, x_row, w_row, out_row, out_split,
                    BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, SPLIT: tl.constexpr):
    """Out[s, rows, outs] = (X[rows, ins] · W[outs, ins]ᵀ) · XScale[rows] · WScale[outs] over every SPLIT-th block
    of the inner dimension from block s on (program (o, s)), summed in float32. Each float8 weight is read once."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    for start in range(split * BLOCK_IN, ins, BLOCK_IN * SPLIT):
        inner = start + tl.arange(0, BLOCK_IN)
        x = tl.load(X + row[:, None] * x_row + inner[None, :], mask=(row[:, None] < rows) & (inner[None, :] < ins),
                    other=0.0)
        w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=(out[:, None] < outs) & (inner[None, :] < ins),
                    other=0.0)
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    acc = acc * tl.load(XScale + row, mask=row < rows, other=0.0)[:, None]
    acc = acc * tl.load(WScale + out, mask=out < outs, other=0.0)[None, :]
    tl.store(Out + split * out_split + row[:, None] * out_row + out[None, :], acc.to(Out.dtype.element_ty),
             mask=(row[:, None] < rows) & (out[None, :] < outs))


@triton.jit
def fp8_gated_rows_kernel(X, XScale, W, WScale, H, Maxes, rows, size, ins, x_row, w_row, h_row,
                          BLOCK_ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_IN: tl.constexpr, EXACT: tl.constexpr):
    """H[rows, size] = silu(G) · U, where G and U are `fp8_rows_kernel`'s products of X with W's first and second
    `size` rows (gate, then up), each in H's dtype; program b makes columns b·HALF … and leaves each row's max |H|
    over them in Maxes[b, rows]. Each float8 weight is read once."""
    block = tl.program_id(0)
    row = tl.arange(0, BLOCK_ROWS)
    col = block * HALF + tl.arange(0, HALF)
    gate = tl.zeros((BLOCK_ROWS, HALF), dtype=tl.float32)
    up = tl.zeros((BLOCK_ROWS, HALF), dtype=tl.float32)
    for start in range(0, ins, BLOCK_IN):
        inner = start + tl.arange(0, BLOCK_IN)
        x = tl.load(X + row[:, None] * x_row + inner[None, :], mask=(row[:, None] < rows) & (inner[None, :] < ins),
                    other=0.0).to(tl.float16)
        w_mask = (col[:, None] < size) & (inner[None, :] < ins)
        w_gate = tl.load(W + col[:, None] * w_row + inner[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(W + (col[:, None] + size) * w_row + inner[None, :], mask=w_mask, other=0.0)
        gate += tl.dot(x, tl.trans(w_gate.to(tl.float16)))
        up += tl.dot(x, tl.trans(w_up.to(tl.float16)))
    row_scale = tl.load(XScale + row, mask=row < rows, other=0.0)[:, None]
    gate = gate * row_scale * tl.load(WScale + col, mask=col < size, other=0.0)[None, :]
    up = up * row_scale * tl.load(WScale + size + col, mask=col < size, other=0.0)[None, :]
    gated_epilogue(gate.to(H.dtype.element_ty), up.to(H.dtype.element_ty), H, Maxes, block, row, col, rows, size,
                   h_row, MAXES=True, EXACT=EXACT)
