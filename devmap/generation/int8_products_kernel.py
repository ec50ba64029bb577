"""The Triton kernel behind `int8_products.int8_product` (imported only where it runs: Triton comes with torch's CUDA
wheels): one program per block of output rows, over the whole inner dimension."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_rows_product(X, W, Scale, Out, rows, outs, ins, x_row, w_row, out_row,
                      BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr):
    """Out[rows, outs] = X[rows, ins] · (W[outs, ins] in X's dtype)ᵀ · Scale[outs], accumulated in float32 and
    scaled once at the end. Each int8 weight is read once."""
    block = tl.program_id(0)
    row = tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    for start in range(0, ins, BLOCK_IN):
        inner = start + tl.arange(0, BLOCK_IN)
        x = tl.load(X + row[:, None] * x_row + inner[None, :], mask=(row[:, None] < rows) & (inner[None, :] < ins),
                    other=0.0)
        w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=(out[:, None] < outs) & (inner[None, :] < ins),
                    other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(Scale + out, mask=out < outs, other=0.0)[None, :]
    tl.store(Out + row[:, None] * out_row + out[None, :], acc.to(Out.dtype.element_ty),
             mask=(row[:, None] < rows) & (out[None, :] < outs))
