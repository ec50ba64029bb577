"""The Triton kernels behind `four_bit_products.four_bit_product` (imported only where they run: Triton comes with
torch's CUDA wheels), over devmap's 4-bit layout: per group of GROUP weights of an output row, GROUP / 2 bytes, byte
j holding weight j in its low half and weight GROUP / 2 + j in its high half, so that both halves meet contiguous
inputs (no shuffle in registers).

- `four_bit_rows_kernel` (up to a few tiles of rows): one program per block of output columns, share of the
  inner dimension and block of rows (a decode step's rows are one block: each weight is read once), each weight's
  value computed in registers (in float32, then in the inputs' dtype, as the libraries' kernels do) and multiplied on
  tensor cores; shares are added in a fixed order by `int8_products_kernel.add_shares`.
- `four_bit_values_kernel` (more rows): the weight's values written out in half
  precision, one program per block of output columns and group, for a full-precision product (cuBLAS) to read."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _values(packed, Scale, Zero, out, scale_row, group, keep_outs):
    """The weights (float32) that the low and high halves of `packed` (outputs `out` × half a group) stand for: (q -
    8) · scale + zero, the group's scale and zero of each output."""
    scale = tl.load(Scale + out * scale_row + group, mask=keep_outs, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(Zero + out * scale_row + group, mask=keep_outs, other=0.0).to(tl.float32)[:, None]
    offset = zero - 8.0 * scale
    return (packed & 15).to(tl.float32) * scale + offset, (packed >> 4).to(tl.float32) * scale + offset


@triton.jit
def four_bit_rows_kernel(X, W, Scale, Zero, Out, rows, outs, ins, x_row, w_row, scale_row, out_row, out_split,
                         GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr,
                         SPLIT: tl.constexpr):
    """Out[s, rows, outs] = X[rows, ins] · Wᵀ over every SPLIT-th group of the inner dimension from group s on
    (program (o, s, r), r the block of rows), in float32, W[o, i] = (q - 8) · Scale[o, g] + Zero[o, g], g = i //
    GROUP (int4). The weights are the products' first operand (W · Xᵀ): Triton converts them to half precision in
    the registers the tensor cores read them from (as the second operand they went through shared memory: ~10% slower
    over a 13B layer, H200)."""
    HALF: tl.constexpr = GROUP // 2
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    half = tl.arange(0, HALF)
    keep_rows = row[None, :] < rows
    keep_outs = out < outs
    acc = tl.zeros((BLOCK_OUT, BLOCK_ROWS), dtype=tl.float32)
    for group in range(split, ins // GROUP, SPLIT):
        inputs = X + row[None, :] * x_row + group * GROUP + half[:, None]
        x_low = tl.load(inputs, mask=keep_rows, other=0.0)
        x_high = tl.load(inputs + HALF, mask=keep_rows, other=0.0)
        packed = tl.load(W + out[:, None] * w_row + group * HALF + half[None, :], mask=keep_outs[:, None], other=0)
        low, high = _values(packed, Scale, Zero, out, scale_row, group, keep_outs)
        acc += tl.dot(low.to(x_low.dtype), x_low)
        acc += tl.dot(high.to(x_low.dtype), x_high)
    tl.store(Out + split * out_split + row[None, :] * out_row + out[:, None], acc.to(Out.dtype.element_ty),
             mask=keep_rows & keep_outs[:, None])


@triton.jit
def four_bit_values_kernel(W, Scale, Zero, Out, outs, w_row, scale_row, out_row, GROUP: tl.constexpr,
                           BLOCK_OUT: tl.constexpr):
    """Out[o, i] = W[o, i] (as in `four_bit_rows_kernel`, computed in float32) in Out's dtype, for the block of
    output columns program_id(0) and the group program_id(1)."""
    HALF: tl.constexpr = GROUP // 2
    out = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    group = tl.program_id(1)
    half = tl.arange(0, HALF)
    keep = out[:, None] < outs
    packed = tl.load(W + out[:, None] * w_row + group * HALF + half[None, :], mask=keep, other=0)
    low, high = _values(packed, Scale, Zero, out, scale_row, group, out < outs)
    values = Out + out[:, None] * out_row + group * GROUP + half[None, :]
    tl.store(values, low.to(Out.dtype.element_ty), mask=keep)
    tl.store(values + HALF, high.to(Out.dtype.element_ty), mask=keep)
