"""The Triton kernel of `split_k`: the parts of a split product added in a fixed order (imported only where it
runs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_parts_kernel(Parts, Out, count, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Out[i] = Σ_s Parts[s, i] (s = 0, 1, …: always this order), in Out's dtype; Parts float32, both contiguous."""
    place = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = place < count
    acc = tl.load(Parts + place, mask=keep, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(Parts + s * count + place, mask=keep, other=0.0)
    tl.store(Out + place, acc.to(Out.dtype.element_ty), mask=keep)
