"""The Triton kernels behind `int8_products.int8_product` (imported only where they run: Triton comes with torch's
CUDA wheels). Decode steps (few rows): one program per block of output columns and share of the inner dimension,
and, where the inner dimension is split, a second kernel that adds the shares in a fixed order (the same sums on
every run). Prefills (many rows): one program per tile of rows × output columns."""

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


@triton.jit
def add_shares(Shares, Out, count, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Out[i] = Σ_s Shares[s, i] (s = 0, 1, …: always this order), in Out's dtype; Shares float32, both contiguous."""
    place = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = place < count
    acc = tl.load(Shares + place, mask=keep, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(Shares + s * count + place, mask=keep, other=0.0)
    tl.store(Out + place, acc.to(Out.dtype.element_ty), mask=keep)


@triton.jit
def int8_tiles_kernel(X, W, Scale, Out, rows, outs, ins, x_row, w_row, out_row,
                      BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
                      WEIGHTS_FIRST: tl.constexpr, EVEN_IN: tl.constexpr):
    """Out[rows, outs] = X[rows, ins] · (W[outs, ins] in X's dtype)ᵀ · Scale[outs] for prefills: program (r, o) makes
    the tile of row block r and output block o, accumulated in float32. Row blocks are the grid's first axis, so the
    programs that run together share their weight block (read from HBM once, then from L2). WEIGHTS_FIRST computes
    the transposed tile (W · Xᵀ), with the converted weights as the product's first operand (on Hopper, the one that
    may come from registers); EVEN_IN: `ins` is a multiple of BLOCK_IN (no mask on the inner dimension)."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    out = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    if WEIGHTS_FIRST:
        acc = tl.zeros((BLOCK_OUT, BLOCK_ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    keep_row = row < rows
    keep_out = out < outs
    for start in range(0, ins, BLOCK_IN):
        inner = start + tl.arange(0, BLOCK_IN)
        x_mask = keep_row[:, None]
        w_mask = keep_out[:, None]
        if not EVEN_IN:
            x_mask = x_mask & (inner[None, :] < ins)
            w_mask = w_mask & (inner[None, :] < ins)
        x = tl.load(X + row[:, None] * x_row + inner[None, :], mask=x_mask, other=0.0)
        w = tl.load(W + out[:, None] * w_row + inner[None, :], mask=w_mask, other=0)
        if WEIGHTS_FIRST:
            acc += tl.dot(w.to(x.dtype), tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    scale = tl.load(Scale + out, mask=keep_out, other=0.0)
    if WEIGHTS_FIRST:
        acc = acc * scale[:, None]
        tl.store(Out + row[None, :] * out_row + out[:, None], acc.to(Out.dtype.element_ty),
                 mask=keep_row[None, :] & keep_out[:, None])
    else:
        acc = acc * scale[None, :]
        tl.store(Out + row[:, None] * out_row + out[None, :], acc.to(Out.dtype.element_ty),
                 mask=keep_row[:, None] & keep_out[None, :])
