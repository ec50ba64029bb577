"""Matrix products with int8 weights that carry one scale per output row (what `--quantize int8` stores), as decode
steps run them: a decode step's few rows make each product a read of its weights, and torchao's product
(`mm(x, w.to(x.dtype)) * scale`) first writes a full-precision copy of the weight (about 2.5× the bytes of the
full-precision product itself). On CUDA, for up to KERNEL_ROWS rows, a Triton kernel reads the int8 weights once and
converts them in registers (`int8_products_kernel`); anything else runs torchao's formula, with its numbers.
"""

from __future__ import annotations

import torch

KERNEL_ROWS = 64  # rows (tokens) up to which the kernel runs: decode steps; prefills are compute-bound products
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def kernel_applies(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `int8_product` runs the kernel for `x` (rows × in): CUDA, half precision, at most KERNEL_ROWS rows,
    contiguous int8 weights and float scales."""
    return (x.is_cuda and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS
            and x.stride(1) == 1 and qdata.dtype == torch.int8 and qdata.is_contiguous()
            and scale.is_contiguous() and scale.dtype.is_floating_point)


def int8_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · (qdata (out × in, int8) × scale (out or out × 1))ᵀ (+ bias), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if kernel_applies(flat, qdata, scale):
        out = _kernel_product(flat, qdata, scale)
    else:  # torchao's per-row weight-only product, operation for operation
        out = torch.mm(flat, qdata.t().to(x.dtype))
        out = out * scale.to(out.dtype).flatten()
    out = out.reshape(*x.shape[:-1], qdata.shape[0])
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def _kernel_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    import triton

    from .int8_products_kernel import int8_rows_product

    rows, ins = x.shape
    outs = qdata.shape[0]
    block_out = 32 if outs < 8192 else 64  # at least one program per SM of an H100 for a 5,120-row product
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    int8_rows_product[(triton.cdiv(outs, block_out),)](
        x, qdata, scale, out, rows, outs, ins, x.stride(0), qdata.stride(0), out.stride(0),
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=block_out, BLOCK_IN=128, num_warps=4,
        num_stages=3)
    return out
