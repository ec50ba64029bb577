"""The Triton side of `gated`: a gated product's epilogue (imported only where it runs)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def gated_epilogue(gate, up, H, Maxes, block, row, col, rows, size, h_row, MAXES: tl.constexpr,
                   EXACT: tl.constexpr):
    """Store silu(gate) · up (gate and up: BLOCK_ROWS × HALF in H's dtype, rounded as the product's output) into
    H[row, col], each step rounded to H's dtype as torch's SiLU and product round theirs; with MAXES, each row's max
    |h| over these columns into Maxes[block, row]. EXACT (on a GPU): SiLU's exp and division as torch's CUDA kernel
    computes them (CUDA's expf, a correctly rounded division), so h has the bits of the module's own operations;
    else (Triton's interpreter, which has neither) Triton's."""
    g = gate.to(tl.float32)
    if EXACT:
        silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(H.dtype.element_ty)
    else:
        silu = (g / (1.0 + tl.exp(-g))).to(H.dtype.element_ty)
    h = (silu.to(tl.float32) * up.to(tl.float32)).to(H.dtype.element_ty)
    keep = (row[:, None] < rows) & (col[None, :] < size)
    tl.store(H + row[:, None] * h_row + col[None, :], h, mask=keep)
    if MAXES:
        most = tl.max(tl.where(keep, tl.abs(h.to(tl.float32)), 0.0), axis=1)
        tl.store(Maxes + block * rows + row, most, mask=row < rows)


@triton.jit
def gate_kernel(Out, H, Maxes, rows, size, out_row, h_row, BLOCK_ROWS: tl.constexpr, HALF: tl.constexpr,
                MAXES: tl.constexpr, EXACT: tl.constexpr):
    """`gated_epilogue` over a joined gate/up product's output (Out: rows × 2·size, gate then up), program b making
    columns b·HALF …: the gate of a product made by the plain kernel."""
    block = tl.program_id(0)
    row = tl.arange(0, BLOCK_ROWS)
    col = block * HALF + tl.arange(0, HALF)
    keep = (row[:, None] < rows) & (col[None, :] < size)
    gate = tl.load(Out + row[:, None] * out_row + col[None, :], mask=keep, other=0.0)
    up = tl.load(Out + row[:, None] * out_row + size + col[None, :], mask=keep, other=0.0)
    gated_epilogue(gate, up, H, Maxes, block, row, col, rows, size, h_row, MAXES=MAXES, EXACT=EXACT)
