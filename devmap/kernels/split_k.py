"""Split-K, as every product kernel here does it: a product whose output columns make too few programs to keep the
SMs reading splits its inner dimension into `splits` parts, each program writing its part's float32 partial sums
into a buffer of its own, and one more kernel adds the parts in a fixed order (part 0, 1, …: the same sums on every
run, which atomic adds would not give). Written once for the int8 and 4-bit products."""

from __future__ import annotations

import torch

SUM_BLOCK = 1024  # outputs each program of the sum adds


def partial_sums(out: torch.Tensor, splits: int) -> torch.Tensor:
    """Where a product kernel writes: `out` itself in one part, else a float32 buffer of `splits` × out's shape."""
    return out if splits == 1 else torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)


def add_partial_sums(parts: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """out = Σ parts[s] in part order, in out's dtype (nothing to do in one part: the kernel wrote `out`)."""
    if splits == 1:
        return
    import triton

    from .split_k_kernel import add_parts_kernel

    count = out.numel()
    add_parts_kernel[(triton.cdiv(count, SUM_BLOCK),)](parts, out, count, SPLIT=splits, BLOCK=SUM_BLOCK)
