"""Matrix products with int8 weights that carry one scale per output row (what `--quantize int8` stores), as decode
steps and prefills run them. torchao's product (`mm(x, w.to(x.dtype)) * scale`) first writes a full-precision copy of
the weight, which at a decode step's few rows costs more bytes than the full-precision product itself and still
costs more than it at a prefill's rows (docs/quantization.md has the figures). On CUDA, in half precision, Triton
kernels read the int8 weights (`int8_products_kernel`):
- up to DECODE_ROWS rows (a decode step; bound by reading the weights): the decode kernel, the weights converted in
  registers, the rows as they are (weight-only int8, torchao's `Int8WeightOnlyConfig`);
- more rows (prefills, steps carrying prompts, large batches; bound by arithmetic): `tokens_product`, each row
  quantized to int8 with a scale of its own (max |x| / 127, as torchao's `Int8DynamicActivationInt8WeightConfig` and
  vLLM's dynamic int8 do; the bits of torch's `(x / scale).round()` on a GPU), then int8 tensor cores, summed exactly
  in int32: a row's product is the same whatever rows it is computed with. Up to 32 rows the products stay
  weight-only: there the tokens' kernel is barely faster at four times the error (docs/kernels.md has the figures).
Anything else (CPU, float32) runs torchao's weight-only formula, with its numbers.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import torch

from .card import HOPPER, Card, card
from .split_k import add_partial_sums, partial_sums

DECODE_ROWS = 32  # rows (tokens) up to which the decode kernel runs (all rows in one block)
TINY_TOKEN_ROWS = 64  # rows up to which `tokens_product`'s tiles are 64 outputs wide (128 beyond)
SMALL_TOKEN_ROWS = 320  # rows up to which `tokens_product`'s tiles are 64 rows high (128 beyond)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class Int8Weight(NamedTuple):
    """An int8 weight with one scale per output row (what `--quantize int8` stores, torchao's per-row layout taken
    apart): `qdata` (out × in, int8) and `scale` (out, or out × 1)."""

    qdata: torch.Tensor
    scale: torch.Tensor


def kernel_applies(x: torch.Tensor, weight: Int8Weight) -> bool:
    """Whether `product` runs a kernel for `x` (rows × in): CUDA, half precision, contiguous int8 weights and float
    scales."""
    qdata, scale = weight
    return (x.is_cuda and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.stride(1) == 1
            and qdata.dtype == torch.int8 and qdata.is_contiguous() and scale.is_contiguous()
            and scale.dtype.is_floating_point)


def product(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · (qdata (out × in, int8) × scale (out or out × 1))ᵀ (+ bias), in x's dtype."""
    qdata, scale = weight
    out = int8_rows_product(x.reshape(-1, x.shape[-1]), qdata, scale).reshape(*x.shape[:-1], qdata.shape[0])
    if bias is not None:
        out = out + bias
    return out


@torch.library.custom_op("devmap::int8_rows_product", mutates_args=())
def int8_rows_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (rows × in) · (qdata × scale)ᵀ in x's dtype: a kernel (by `kernel_applies`, then by rows) or torchao's
    formula. An operator of its own, so that torch.compile calls it as it is: which product runs, and the kernel's
    block shape for the rows at hand, are decided at each call, never guarded on in a compiled step (one compile
    serves every batch size)."""
    if not kernel_applies(x, Int8Weight(qdata, scale)):
        return torchao_formula(x, qdata, scale)
    return kernel_product(x, qdata, scale) if x.shape[0] <= DECODE_ROWS else tokens_product(x, qdata, scale)


def torchao_formula(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torchao's per-row int8 weight-only product, operation for operation (its eager path, with its numbers): a
    full-precision copy of the weight, then the product and the scales."""
    out = torch.mm(x, qdata.t().to(x.dtype))
    return (out * scale.to(out.dtype).flatten()).to(x.dtype)


@int8_rows_product.register_fake
def _(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qdata.shape[0]))


# every block shape, and Triton's specializations of `rows` (1, multiples of 16) up to DECODE_ROWS; then each tile
# of `tokens_product` (whose sizes are not specialized on)
PREPARED_ROWS = (1, 2, 16, 17, DECODE_ROWS, DECODE_ROWS + 1, TINY_TOKEN_ROWS + 1, SMALL_TOKEN_ROWS + 1)


def prepare_kernels(weights: Iterable[Int8Weight], dtype: torch.dtype) -> int:
    """Run the kernels once for each distinct int8 weight shape and each of PREPARED_ROWS, so that
    Triton compiles every variant a step can use now (then caches it on disk) instead of in a service's first
    requests. Returns the products run: 0 where the kernels do not apply (CPU, float32)."""
    seen, runs = set(), 0
    with torch.no_grad():
        for qdata, scale in weights:
            key = (tuple(qdata.shape), qdata.device)
            if key in seen:
                continue
            seen.add(key)
            for rows in PREPARED_ROWS:
                x = torch.zeros(rows, qdata.shape[1], dtype=dtype, device=qdata.device)
                if kernel_applies(x, Int8Weight(qdata, scale)):
                    int8_rows_product(x, qdata, scale)
                    runs += 1
    return runs


class BlockShape(NamedTuple):
    """How a kernel cuts a product: output columns per program, inner-dimension block, split-K parts of the inner
    dimension (`split_k`), Triton's warps and pipeline stages, and rows per program:
    0 for the decode kernel (every row in one block), else `tokens_product`'s tile height (no split)."""

    out: int
    inner: int
    splits: int
    warps: int = 4
    stages: int = 3
    rows: int = 0


NARROW_ROWS = 16  # rows up to which the decode kernel's blocks read 256 inputs a step


def block_shape(rows: int, outs: int, gpu: Card = HOPPER) -> BlockShape:
    """The decode kernel's block shape for a product of `rows` rows (up to DECODE_ROWS), as a rule from the fastest
    of LLaMA-2-13B's products (`benchmarks/probes/int8_matmul.py`; docs/kernels.md): up to NARROW_ROWS, of 36 shapes
    on an H200 at 1 and 16 rows (faster there than the H100's shapes); beyond, of 36 on an H100 at 32 rows (as fast as
    the H200's best). Wide products (qkv, gate_up) have programs enough: up to NARROW_ROWS blocks of 64 output
    columns, 128 where that would make more programs than the card's `programs` (two per SM); narrow ones (o, down:
    fewer output columns than 8,192) split their inner dimension so that every SM has weights to read."""
    if outs >= 8192:
        if rows <= NARROW_ROWS:
            return BlockShape(64 if outs <= 64 * gpu.programs else 128, 256, 1)
        return BlockShape(128, 256, 1)
    return BlockShape(32, 256, 4) if rows <= NARROW_ROWS else BlockShape(64, 128, 8)


def kernel_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                   shape: BlockShape | None = None) -> torch.Tensor:
    """x (rows × in, rows ≤ DECODE_ROWS) · (qdata × scale)ᵀ through the decode kernel, cut as `shape` says (default:
    `block_shape`'s rule)."""
    import triton

    from .int8_products_kernel import int8_rows_kernel

    rows, ins = x.shape
    outs = qdata.shape[0]
    shape = shape or block_shape(rows, outs, card(x.device))
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    parts = partial_sums(out, shape.splits)
    int8_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits)](
        x, qdata, scale, parts, rows, outs, ins, x.stride(0), qdata.stride(0), outs, rows * outs,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=shape.out, BLOCK_IN=shape.inner,
        SPLIT=shape.splits, num_warps=shape.warps, num_stages=shape.stages)
    add_partial_sums(parts, out, shape.splits)
    return out


ONE_PASS_ROW = 16384  # elements up to which the per-token quantization reads a row once (else twice, 1,024 a step)


def tokens_block_shape(rows: int) -> BlockShape:
    """The tile of `tokens_product` for `rows` rows: the fastest over a layer of LLaMA-2-13B's four products, as a
    rule (10 tiles timed on an H200 at 96-2,080 rows, `benchmarks/probes/int8_matmul.py --rows 96,…,2080`; 81 on an
    H100 at 64, `--rows 64 --tile-grid`): 64 rows × 64 outputs × 256 inner up to TINY_TOKEN_ROWS rows, 64 × 128 ×
    128 up to SMALL_TOKEN_ROWS, then 128 × 128 × 128 with 8 warps."""
    if rows <= TINY_TOKEN_ROWS:
        return BlockShape(64, 256, 1, 4, 3, rows=64)
    return BlockShape(128, 128, 1, 4, 4, rows=64) if rows <= SMALL_TOKEN_ROWS else \
        BlockShape(128, 128, 1, 8, 3, rows=128)


def tokens_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                   shape: BlockShape | None = None) -> torch.Tensor:
    """x (rows × in) · (qdata × scale)ᵀ with x's rows quantized per token to int8 first (`quantize_rows_kernel`,
    one program a row), then int8 × int8 tiles (`int8_tokens_tiles_kernel`) cut as `shape` says (default:
    `tokens_block_shape`'s rule)."""
    import triton

    from .int8_products_kernel import SMALLEST_NORMAL, int8_tokens_tiles_kernel, quantize_rows_kernel

    rows, ins = x.shape
    outs = qdata.shape[0]
    shape = shape or tokens_block_shape(rows)
    quantized = torch.empty((rows, ins), dtype=torch.int8, device=x.device)
    token_scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(ins) if ins <= ONE_PASS_ROW else 1024
    quantize_rows_kernel[(rows,)](x, quantized, token_scales, ins, x.stride(0), BLOCK=block,
                                  ONE_PASS=ins <= ONE_PASS_ROW,
                                  RECIPROCAL_FROM=SMALLEST_NORMAL if x.is_cuda else math.inf,
                                  num_warps=min(16, max(4, block // 1024)))
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    int8_tokens_tiles_kernel[(triton.cdiv(rows, shape.rows), triton.cdiv(outs, shape.out))](
        quantized, token_scales, qdata, scale, out, rows, outs, ins, qdata.stride(0), outs, BLOCK_ROWS=shape.rows,
        BLOCK_OUT=shape.out, BLOCK_IN=shape.inner, EVEN_IN=ins % shape.inner == 0, num_warps=shape.warps,
        num_stages=shape.stages)
    return out
