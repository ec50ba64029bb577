"""A LLaMA feed-forward's gate in the product that makes it: silu(x · gateᵀ) · (x · upᵀ) straight out of the joined
gate/up product's kernel, instead of that product's output written, read back and gated by a kernel of its own (and,
for fp8, each row's max |h| read by one kernel more before its tokens are quantized in a third). A decode step is
bound by reading weights; at one row each of those small kernels costs about as long to launch as to run, three of
them a layer on fp8 (docs/kernels.md has the per-step timeline).

A gated product's program reads HALF columns of the gate and the same HALF of the up weights, so it has both halves of
its outputs; each program also leaves the largest |h| of each row over its HALF columns (`maxes`: programs × rows,
float32), from which the fp8 down product takes each row's scale (the max of the maxima: torchao's max |x|) and
quantizes its tokens as it reads them. This module holds what the families share: when a gated product applies, the
torch formula where it does not (the module's own ops: `F.silu(gate) * up`) and the row maxima of a gated output
made by torch (products past the decode rows)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

HALF = 64  # gate columns (and up columns) one program of a gated product makes; the columns each row maximum covers
GATED_ROWS = 16  # rows up to which the gated kernels run; past them (to the decode rows) the plain decode kernel and
# `gated_by_kernel` (the gated kernels' two accumulators of HALF columns were 4-6% slower a step at 32 rows)
GATED_ACTIVATIONS = ("silu", "swish")  # transformers' names of the activation the kernels apply
WIDE_OUTS = 8192  # outputs from which a decode product is not cut along its inner dimension (`int8_products`)


def gated_applies(outs: int, sizes: list[int], activation: str | None, bias: torch.Tensor | None) -> bool:
    """Whether a joined product of `outs` outputs in `sizes` (gate, up) with `activation` can be gated by its kernel:
    gate and up alike in size, SiLU, no bias, and wide enough that the kernel is not cut along its inner dimension
    (every program sums whole rows)."""
    return (len(sizes) == 2 and sizes[0] == sizes[1] and activation in GATED_ACTIVATIONS and bias is None
            and outs >= WIDE_OUTS)


def gated_by_torch(out: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of a joined product's output (… × 2·size: gate, then up), as the MLP's own operations do."""
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


def parts(size: int) -> int:
    """Row maxima a gated output of `size` columns has: one per HALF columns."""
    return -(-size // HALF)


def row_maxes(h: torch.Tensor) -> torch.Tensor:
    """The maxima a gated kernel leaves (parts × rows, float32: max |h| over each HALF columns of each row), of a
    gated output `h` (rows × size) made by torch."""
    rows, size = h.shape
    padded = F.pad(h.abs(), (0, parts(size) * HALF - size))
    return padded.view(rows, parts(size), HALF).amax(dim=-1).t().float().contiguous()


def gated_by_kernel(out: torch.Tensor, maxes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(silu(gate) · up, its row maxima if `maxes`, else None) of a joined product's output (rows × 2·size, on a GPU)
    in one kernel (`gated_kernel.gate_kernel`): the gate of products past the rows a gated kernel runs at."""
    import triton

    from .gated_kernel import gate_kernel

    rows, size = out.shape[0], out.shape[1] // 2
    h = torch.empty((rows, size), dtype=out.dtype, device=out.device)
    row_max = torch.empty((parts(size), rows), dtype=torch.float32, device=out.device) if maxes else h
    gate_kernel[(parts(size),)](out, h, row_max, rows, size, out.stride(0), size,
                                BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), HALF=HALF, MAXES=maxes,
                                EXACT=out.is_cuda)
    return h, (row_max if maxes else None)
