"""The Triton kernels behind `int8_products.product` (imported only where they run: Triton comes with torch's
CUDA wheels). Decode steps (few rows): one program per block of output columns and split-K part of the inner
dimension (`split_k` adds the parts). More rows: each row quantized to int8 (one program a row), then one program per
tile of rows × output columns on int8 tensor cores."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_rows_kernel(X, W, Scale, Out, rows, outs, ins, x_row, w_row, out_row, out_split,
                      BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
                      SPLIT: tl.constexpr):
    """Out[s, rows, outs] = X[rows, ins] · (W[outs, ins] in X's dtype)ᵀ · Scale[outs] over every SPLIT-th block of
    the inner dimension from block s on (program (o, s)), accumulated in float32. Each int8 weight is read once."""
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
                    other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(Scale + out, mask=out < outs, other=0.0)[None, :]
    tl.store(Out + split * out_split + row[:, None] * out_row + out[None, :], acc.to(Out.dtype.element_ty),
             mask=(row[:, None] < rows) & (out[None, :] < outs))


# 1.5 · 2**23: v + ROUNDING - ROUNDING is float32 v rounded half to even (|v| < 2**22)
ROUNDING = tl.constexpr(12582912.0)
ONE_127TH = tl.constexpr(0.007874015718698502)  # 1 / 127 rounded to float32
SMALLEST_NORMAL = 2.0 ** -126  # float32's: a GPU's `RECIPROCAL_FROM` (`_rounded_int8`)


@triton.jit
def _token_scale(most):
    """A row's scale, max |x| / 127 as torch computes it on a GPU (max · 1/127, the reciprocal rounded to float32),
    1 for an all-zero row, and the scale's reciprocal correctly rounded (Triton's `/` is approximate on GPUs)."""
    scale = tl.where(most > 0, most * ONE_127TH, 1.0)
    return scale, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)


@triton.jit
def _rounded_int8(x, scale, inverse, RECIPROCAL_FROM: tl.constexpr):
    """round(x / scale) as int8 (`inverse` = 1 / scale correctly rounded), with the quotient correctly rounded and
    then rounded half to even, as torch's `(x / scale).round()`. A scale of at least RECIPROCAL_FROM: x · inverse
    corrected once by its exact residual (fused multiply-adds, rounded once), where a correctly rounded division
    bounds the quantizing kernel (docs/kernels.md); on a GPU (RECIPROCAL_FROM = SMALLEST_NORMAL) equal to the division's
    for every float16 and bfloat16 value of x and of the row's max (checked exhaustively). A smaller scale (a
    subnormal one: a row's max under ~1.5e-36; any in Triton's interpreter, whose fma rounds the product first, where
    RECIPROCAL_FROM is inf): the division."""
    if scale >= RECIPROCAL_FROM:
        quotient = x * inverse
        quotient = tl.math.fma(tl.math.fma(-quotient, scale, x), inverse, quotient)
    else:
        quotient = tl.math.div_rn(x, scale)
    return ((quotient + ROUNDING) - ROUNDING).to(tl.int8)


@triton.jit
def quantize_rows_kernel(X, Q, Scales, ins, x_row, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                         RECIPROCAL_FROM: tl.constexpr):
    """Q[r] = round(X[r] / Scales[r]) in int8 (Q contiguous), Scales[r] = max |X[r]| / 127 (program r: one row,
    float32 arithmetic); an all-zero row gets scale 1. ONE_PASS: the row fits one BLOCK (read once), else twice.
    RECIPROCAL_FROM: the smallest scale quantized by its reciprocal (`_rounded_int8`)."""
    row = tl.program_id(0)
    if ONE_PASS:
        inner = tl.arange(0, BLOCK)
        x = tl.load(X + row * x_row + inner, mask=inner < ins, other=0.0).to(tl.float32)
        scale, inverse = _token_scale(tl.max(tl.abs(x), axis=0))
        tl.store(Q + row * ins + inner, _rounded_int8(x, scale, inverse, RECIPROCAL_FROM), mask=inner < ins)
    else:
        biggest = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, ins, BLOCK):
            inner = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * x_row + inner, mask=inner < ins, other=0.0).to(tl.float32)
            biggest = tl.maximum(biggest, tl.abs(x))
        scale, inverse = _token_scale(tl.max(biggest, axis=0))
        for start in range(0, ins, BLOCK):
            inner = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * x_row + inner, mask=inner < ins, other=0.0).to(tl.float32)
            tl.store(Q + row * ins + inner, _rounded_int8(x, scale, inverse, RECIPROCAL_FROM), mask=inner < ins)
    tl.store(Scales + row, scale)


@triton.jit(do_not_specialize=["rows"])
def int8_tokens_tiles_kernel(Q, QScales, W, Scale, Out, rows, outs, ins, w_row, out_row, BLOCK_ROWS: tl.constexpr,
                             BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, EVEN_IN: tl.constexpr):
    """Out[rows, outs] = (Q[rows, ins] · W[outs, ins]ᵀ) · QScales[rows] · Scale[outs] for tokens quantized to int8
    (`quantize_rows_kernel`): program (r, o) makes the tile of row block r and output block o on int8 tensor cores,
    summed in int32 (exact: a row's sums are the same whatever the tile or the other rows). Row blocks are the
    grid's first axis: programs that run together share their weight block (read from HBM once, then from L2)."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    out = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    keep_row = row < rows
    keep_out = out < outs
    sums = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.int32)
    for start in range(0, ins, BLOCK_IN):
        inner = start + tl.arange(0, BLOCK_IN)
        q_mask = keep_row[:, None]
        w_mask = keep_out[:, None]
        if not EVEN_IN:
            q_mask = q_mask & (inner[None, :] < ins)
            w_mask = w_mask & (inner[None, :] < ins)
        q = tl.load(Q + row[:, None] * ins + inner[None, :], mask=q_mask, other=0)
        w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=w_mask, other=0)
        sums = tl.dot(q, tl.trans(w), sums, out_dtype=tl.int32)
    q_scale = tl.load(QScales + row, mask=keep_row, other=0.0)
    scale = tl.load(Scale + out, mask=keep_out, other=0.0)
    product = sums.to(tl.float32) * q_scale[:, None] * scale[None, :]
    tl.store(Out + row[:, None] * out_row + out[None, :], product.to(Out.dtype.element_ty),
             mask=keep_row[:, None] & keep_out[None, :])
