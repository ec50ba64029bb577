"""fp8 products: float8 (e4m3) weights with a scale per output row, each token of the input quantized to float8 as it
comes (the weights torchao's float8 Linear holds), joined like int8 weights. The tokens are quantized as torchao
quantizes them (`compat.torchao_fp8_tokens`: plain torch operations, which a compiled step fuses into the operation
before), then, on CUDA in bfloat16:
- up to DECODE_ROWS rows (a decode step, bound by reading the weights): devmap's kernel (`fp8_products_kernel`),
  cut as the int8 decode kernel is (the weights take the same bytes);
- more rows: `torch._scaled_mm`, called as torchao's Linear calls it.
A feed-forward's joined gate/up product can be gated in its kernel (`gated_product`, see `gated`): its output is the
gated bfloat16 rows with their maxima, from which one kernel makes the down product's float8 tokens
(`product(..., maxes=...)`), torchao's numbers (max |x| / 448 in the tokens' dtype as each row's scale).
Anywhere else (CPU, other dtypes) the product is torchao's Linear itself. docs/kernels.md has the measurements that
set DECODE_ROWS, against torchao's product and gemlite's (whose per-process tuning a service cannot pay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.nn import functional as F

from ..compat import torchao_fp8_fast_accumulation, torchao_fp8_tokens, torchao_fp8_tokens_of, torchao_fp8_weight
from .card import card
from .gated import (GATED_ACTIVATIONS, GATED_ROWS, HALF, gated_applies, gated_by_kernel, gated_by_torch, parts,
                    row_maxes)
from .int8_products import block_shape
from .split_k import add_partial_sums, partial_sums

KERNEL_DTYPES = (torch.bfloat16,)  # torchao's float8 products with a scale per row take bfloat16 inputs
DECODE_ROWS = 32  # rows up to which devmap's kernel runs (all rows in one block); `torch._scaled_mm` beyond
BLOCK_PARTS = 64  # row maxima a program of `tokens_from_maxes` reads at a time
TOKENS_BLOCK = 2048  # columns of a row each program of `tokens_from_maxes` quantizes


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


def product(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
            maxes: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype: x's tokens quantized to float8 as torchao does, then
    `fp8_rows_product`; torchao's float8 Linear where the kernels do not apply. With `maxes` (x from `gated_product`,
    which gave them), the tokens are quantized from them, by one kernel at decode rows (`fp8_maxes_rows_product`)."""
    if not kernel_applies(x, weight):
        return F.linear(x, weight.library, bias)
    rows = x.reshape(-1, x.shape[-1])
    if maxes is not None:
        kwargs = weight.library.act_quant_kwargs
        out = fp8_maxes_rows_product(rows, maxes, weight.qdata, weight.scale, weight.fast_accumulation,
                                     kwargs.hp_value_lb, kwargs.hp_value_ub)
    else:
        tokens, scales = torchao_fp8_tokens(rows, weight.library)
        out = fp8_rows_product(tokens, scales, weight.qdata, weight.scale, weight.fast_accumulation)
    out = out.reshape(*x.shape[:-1], weight.qdata.shape[0])
    return out + bias if bias is not None else out


def gated_product(x: torch.Tensor, weight: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """silu(x · gateᵀ) · (x · upᵀ) of a joined gate/up weight (gate's rows, then up's: `gated.gated_applies`), in x's
    dtype, and the row maxima `product` quantizes it with (None where the kernels do not apply: the torch formula
    over torchao's Linear)."""
    if not kernel_applies(x, weight) or weight.library.act_quant_kwargs.float8_dtype != torch.float8_e4m3fn:
        return gated_by_torch(F.linear(x, weight.library)), None
    tokens, scales = torchao_fp8_tokens(x.reshape(-1, x.shape[-1]), weight.library)
    h, maxes = fp8_gated_rows_product(tokens, scales, weight.qdata, weight.scale, weight.fast_accumulation)
    return h.reshape(*x.shape[:-1], h.shape[-1]), maxes


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
    partials = partial_sums(out, shape.splits)
    fp8_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits)](
        tokens, scales, qdata, scale, partials, rows, outs, ins, tokens.stride(0), qdata.stride(0), outs, rows * outs,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=shape.out, BLOCK_IN=shape.inner,
        SPLIT=shape.splits, num_warps=shape.warps, num_stages=shape.stages)
    add_partial_sums(partials, out, shape.splits)
    return out


@torch.library.custom_op("devmap::fp8_gated_rows_product", mutates_args=())
def fp8_gated_rows_product(tokens: torch.Tensor, scales: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                           fast_accumulation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(G) · U in bfloat16, its row maxima: `gated.parts(size)` × rows, float32) for G and U the products of
    `fp8_rows_product` with qdata's two halves (gate, then up): devmap's gated kernel up to `gated.GATED_ROWS` rows,
    the plain kernel and a gate kernel up to DECODE_ROWS, else `torch._scaled_mm` and the torch formula."""
    if tokens.shape[0] > DECODE_ROWS:
        h = gated_by_torch(fp8_rows_product(tokens, scales, qdata, scale, fast_accumulation))
        return h, row_maxes(h)
    if tokens.shape[0] > GATED_ROWS:
        h, maxes = gated_by_kernel(kernel_product(tokens, scales, qdata, scale), maxes=True)
        return h, maxes
    import triton

    from .fp8_products_kernel import fp8_gated_rows_kernel

    rows, ins = tokens.shape
    size = qdata.shape[0] // 2
    h = torch.empty((rows, size), dtype=torch.bfloat16, device=tokens.device)
    maxes = torch.empty((parts(size), rows), dtype=torch.float32, device=tokens.device)
    shape = block_shape(rows, qdata.shape[0], card(tokens.device))
    fp8_gated_rows_kernel[(parts(size),)](
        tokens, scales, qdata, scale, h, maxes, rows, size, ins, tokens.stride(0), qdata.stride(0), size,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), HALF=HALF, BLOCK_IN=shape.inner, EXACT=tokens.is_cuda,
        num_warps=shape.warps,
        num_stages=shape.stages)
    return h, maxes


@fp8_gated_rows_product.register_fake
def _(tokens: torch.Tensor, scales: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
      fast_accumulation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    size = qdata.shape[0] // 2
    return (tokens.new_empty((tokens.shape[0], size), dtype=torch.bfloat16),
            tokens.new_empty((parts(size), tokens.shape[0]), dtype=torch.float32))


@torch.library.custom_op("devmap::fp8_maxes_rows_product", mutates_args=())
def fp8_maxes_rows_product(x: torch.Tensor, maxes: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                           fast_accumulation: bool, lower: float | None, upper: float | None) -> torch.Tensor:
    """`fp8_rows_product` of x (rows × in, bfloat16) quantized per row with the scales its row maxima give (`maxes`:
    parts × rows, from `fp8_gated_rows_product`), as torchao's formula (`compat.torchao_fp8_tokens_of`, its
    activation bounds `lower`/`upper`): the tokens made by one kernel from the maxima up to DECODE_ROWS rows
    (`tokens_from_maxes`; without bounds), else by the formula's torch operations."""
    if x.shape[0] > DECODE_ROWS or lower is not None or upper is not None or not x.is_cuda:
        tokens, scales = torchao_fp8_tokens_of(x, maxes.amax(dim=0).unsqueeze(1), lower, upper)
    else:
        tokens, scales = tokens_from_maxes(x, maxes)
    return fp8_rows_product(tokens, scales, qdata, scale, fast_accumulation)


def tokens_from_maxes(x: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 tokens, float32 scales: rows × 1) of x (rows × size, bfloat16) from its row maxima (`maxes`: parts ×
    rows) in one kernel, torchao's numbers (`compat.torchao_fp8_tokens_of` without bounds)."""
    import triton

    from .fp8_products_kernel import fp8_tokens_from_maxes_kernel

    rows, size = x.shape
    tokens = torch.empty((rows, size), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    fp8_tokens_from_maxes_kernel[(rows, triton.cdiv(size, TOKENS_BLOCK))](
        x, maxes, tokens, scales, rows, size, maxes.shape[0], x.stride(0), BLOCK=TOKENS_BLOCK,
        BLOCK_PARTS=BLOCK_PARTS, ROUND_FIRST=not x.is_cuda)
    return tokens, scales


@fp8_maxes_rows_product.register_fake
def _(x: torch.Tensor, maxes: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, fast_accumulation: bool,
      lower: float | None, upper: float | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], qdata.shape[0]), dtype=torch.bfloat16)


# Triton's specializations of `rows` (1, multiples of 16) and both block heights up to DECODE_ROWS, then past them
PREPARED_ROWS = (1, 2, 16, 17, DECODE_ROWS, DECODE_ROWS + 1)


def prepare_kernels(weights: Iterable[Fp8Weight], dtype: torch.dtype) -> int:
    """Run the products once for each distinct weight shape and each of PREPARED_ROWS (quantizing tokens first and
    from row maxima; gated too where the shape can be a gate/up pair's), so that Triton compiles every variant a step
    can use now (then caches it on disk) instead of in a service's first requests. Returns the products run: 0 where
    the kernels do not apply (CPU, float32)."""
    seen, runs = set(), 0
    with torch.no_grad():
        for weight in weights:
            key = (tuple(weight.shape), weight.qdata.device)
            if key in seen:
                continue
            seen.add(key)
            outs, ins = weight.shape
            for rows in PREPARED_ROWS:
                x = torch.zeros(rows, ins, dtype=dtype, device=weight.qdata.device)
                if not kernel_applies(x, weight):
                    continue
                product(x, weight)
                product(x, weight, maxes=torch.ones(parts(ins), rows, device=x.device))
                runs += 2
                if gated_applies(outs, [outs // 2, outs - outs // 2], GATED_ACTIVATIONS[0], None):
                    gated_product(x, weight)
                    runs += 1
    return runs
