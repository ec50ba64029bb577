"""The Triton kernel behind `fp8_products.product` at decode rows (imported only where it runs: Triton comes with
torch's CUDA wheels): one program per block of output columns and split-K part of the inner dimension (`split_k`
adds the parts), as the int8 decode kernel cuts its products. Tokens and weights are float8 (e4m3) with a scale per
row; both are widened to float16, which holds every e4m3 value exactly, so each product of two of them is exact and
the sums are float32, as `torch._scaled_mm`'s."""

from __future__ import annotations

import triton
import triton.language as tl


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
