"""fp8 products: float8 (e4m3) weights with a scale per output row, each token of the input quantized to float8 as it
comes (the weights torchao's float8 Linear holds), joined like int8 weights. The tokens are quantized as torchao
quantizes them (`compat.torchao_fp8_tokens`: plain torch operations, which a compiled step fuses into the operation
before), then, on CUDA in bfloat16:
- up to DECODE_ROWS rows (a decode step, bound by reading the weights): devmap's kernel (`fp8_products_kernel`),
  cut as the int8 decode kernel is (the weights take the same bytes);
- more rows: `torch._scaled_mm`, called as torchao's Linear calls it.
Anywhere else (CPU, other dtypes) the product is torchao's Linear itself. docs/kernels.md has the measurements that
set DECODE_ROWS, against torchao's product and gemlite's (whose per-process tuning a service cannot pay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.nn import functional as F

from ..compat import torchao_fp8_fast_accumulation, torchao_fp8_tokens, torchao_fp8_weight
from .card import card
from .int8_products import block_shape
from .split_k import add_partial_sums, partial_sums

KERNEL_DTYPES = (torch.bfloat16,)  # torchao's float8 products with a scale per row take bfloat16 inputs
DECODE_ROWS = 32  # rows up to which devmap's kernel runs (all rows in one block); `torch._scaled_mm` beyond


@dataclass(eq=False)
class Fp8Weight:
    """A float8 weight (`qdata`: out × in, float8_e4m3fn; `scale`: out × 1, float32), torchao's float8 weight of the
    same tensors (`library`: how its Linear quantizes tokens and multiplies) and whether that product accumulates
    fast (`fast_accumulation`, `torch._scaled_mm`'s `use_fast_accum`)."""

    qdata: torch.Tensor
    scale: torch.Tensor
    library: Any
    fast_accumulation: bool = False

    @classmethod
    def of(cls, qdata: torch.Tensor, scale: torch.Tensor, like: Any) -> Fp8Weight:
        """The weight of these tensors, its torchao weight with `like`'s settings (a weight of the model's)."""
        return cls(qdata, scale, torchao_fp8_weight(qdata, scale, like), torchao_fp8_fast_accumulation(like))

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape


def kernel_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether `product` quantizes `x`'s tokens itself and runs devmap's kernel or `torch._scaled_mm` on them: CUDA,
    bfloat16, contiguous float8 weights and float32 scales."""
    return (x.is_cuda and x.dtype in KERNEL_DTYPES and x.dim() >= 1
            and weight.qdata.dtype == torch.float8_e4m3fn and weight.qdata.is_contiguous()
            and weight.scale.dtype == torch.float32 and weight.scale.is_contiguous())


def product(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype: x's tokens quantized to float8 as torchao does, then
    `fp8_rows_product`; torchao's float8 Linear where the kernels do not apply."""
    if not kernel_applies(x, weight):
        return F.linear(x, weight.library, bias)
    tokens, scales = torchao_fp8_tokens(x.reshape(-1, x.shape[-1]), weight.library)
    out = fp8_rows_product(tokens, scales, weight.qdata, weight.scale, weight.fast_accumulation)
    out = out.reshape(*x.shape[:-1], weight.qdata.shape[0])
    return out + bias if bias is not None else out


@torch.library.custom_op("devmap::fp8_rows_product", mutates_args=())
def fp8_rows_product(tokens: torch.Tensor, scales: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                     fast_accumulation: bool) -> torch.Tensor:
    """(tokens (rows × in, float8) · qdata (out × in, float8)ᵀ) · scales (rows × 1) · scale (out × 1), in bfloat16:
    devmap's kernel up to DECODE_ROWS rows, else `torch._scaled_mm` as torchao's Linear calls it. An operator of its
    own, so that which product runs is decided at each call, never guarded on in a compiled step."""
    if tokens.shape[0] <= DECODE_ROWS:
        return kernel_product(tokens, scales, qdata, scale)
    return torch._scaled_mm(tokens, qdata.t(), scale_a=scales, scale_b=scale.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accumulation)


@fp8_rows_product.register_fake
def _(tokens: torch.Tensor, scales: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
      fast_accumulation: bool) -> torch.Tensor:
    return tokens.new_empty((tokens.shape[0], qdata.shape[0]), dtype=torch.bfloat16)


def kernel_product(tokens: torch.Tensor, scales: torch.Tensor, qdata: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """The product of `fp8_rows_product` for up to DECODE_ROWS rows through devmap's kernel, cut as the int8 decode
    kernel's rule says (`int8_products.block_shape`)."""
    import triton

    from .fp8_products_kernel import fp8_rows_kernel

    rows, ins = tokens.shape
    outs = qdata.shape[0]
    shape = block_shape(rows, outs, card(tokens.device))
    out = torch.empty((rows, outs), dtype=torch.bfloat16, device=tokens.device)
    parts = partial_sums(out, shape.splits)
    fp8_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits)](
        tokens, scales, qdata, scale, parts, rows, outs, ins, tokens.stride(0), qdata.stride(0), outs, rows * outs,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=shape.out, BLOCK_IN=shape.inner,
        SPLIT=shape.splits, num_warps=shape.warps, num_stages=shape.stages)
    add_partial_sums(parts, out, shape.splits)
    return out


# Triton's specializations of `rows` (1, multiples of 16) and both block heights up to DECODE_ROWS, then past them
PREPARED_ROWS = (1, 2, 16, 17, DECODE_ROWS, DECODE_ROWS + 1)


def prepare_kernels(weights: Iterable[Fp8Weight], dtype: torch.dtype) -> int:
    """Run the products once for each distinct weight shape and each of PREPARED_ROWS, so that Triton compiles every
    variant a step can use now (then caches it on disk) instead of in a service's first requests. Returns the
    products run: 0 where the kernels do not apply (CPU, float32)."""
    seen, runs = set(), 0
    with torch.no_grad():
        for weight in weights:
            key = (tuple(weight.shape), weight.qdata.device)
            if key in seen:
                continue
            seen.add(key)
            for rows in PREPARED_ROWS:
                x = torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.qdata.device)
                if kernel_applies(x, weight):
                    product(x, weight)
                    runs += 1
    return runs
