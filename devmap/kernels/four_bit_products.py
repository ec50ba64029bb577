"""Matrix products with 4-bit weights (`--quantize int4`: torchao's numbers, tinygemm's formula, w = (q - 8) · scale +
zero per group of 128 along the inner dimension, q in 0..15; `--quantize nf4`: below) in a plain layout that devmap's
kernels read: two weights a byte (in each span, weight j in the low half of byte j, weight span/2 + j in its high half;
a span is a group of 128 or more weights, or two smaller groups: `four_bit_layout`), output row by output row
(`FourBitWeight`), so that q, k and v (gate and up) lie end to end and a decode step reads each layer in few products.
torchao's tinygemm is built for a row or a few, and is many times bf16's time past them (docs/kernels.md).

On CUDA, in half precision, up to DECODE_ROWS rows (decode steps) `product` runs `four_bit_products_kernel`'s
rows kernel: the 4 bits read once per block of rows (two bytes at a time), each weight made from bit patterns, (q - 8) ·
scale + zero in one half-precision fused multiply-add, rounded once. Up to TILED_ROWS (steps carrying prompts) it runs
Hopper's kernel on an sm_90 GPU (`four_bit_products_wgmma`: the same weights, made while the tensor cores multiply the
group before), the rows kernel elsewhere; more rows (prefills) write the weight's values in half precision (computed in
float32 and rounded, as tinygemm does), then cuBLAS's product reads them. Only the sums' order and, rarely, a weight's
last bit differ from tinygemm's. Anywhere else the same numbers through a full-precision copy (`dequantize`).

bitsandbytes' nf4 (and fp4) is taken into this layout too (`four_bit_linear`): its blocks of 64 are the groups, two a
span, each block's absmax the scale and no zero (the kernels read none), its table of 16 values the `code_values`,
rounded to the scales' dtype on every path; the kernels look a table's code values up by PRMT
(`four_bit_products_kernel.table_ptx`).

4-bit models join apart by default (`mixed_joins.rides_by_default`): a decode step that carries prompts costs int4
more than bf16. The measurements behind each choice here, with their commands, are in docs/kernels.md."""

from __future__ import annotations

import functools
from typing import Iterable, NamedTuple, Optional, Sequence

import torch

from .four_bit_layout import SPAN, FourBitWeight, dequantize, code_value_table, zero_or_scale
from .card import HOPPER, Card, card
from .split_k import add_partial_sums, partial_sums

NARROW_ROWS = 16  # rows up to which a block of 64 output columns takes every row and the rows kernel cuts the inner
# dimension in twice the split-K parts
DECODE_ROWS = 32  # rows up to which (from NARROW_ROWS on) a block of 128 output columns (8 warps) takes every row
WIDE_ROWS = 128  # rows up to which (from DECODE_ROWS on) a block of 64 output columns takes every row
TILED_ROWS = 256  # rows up to which int4 runs the rows kernel, every row in one block of 128 output columns beyond
# WIDE_ROWS (then values + cuBLAS: equal at 288 rows, H200)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
def kernel_applies(x: torch.Tensor, weight: FourBitWeight) -> bool:
    """Whether `product` runs the kernel for `x` (rows × in): CUDA, half precision, contiguous parts (the
    bytes from an even address: read two at a time), groups of at least 32 that are a power of two."""
    group = weight.group
    return (x.is_cuda and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.stride(1) == 1
            and all(t is None or t.is_contiguous() for t in weight.tensors) and weight.packed.data_ptr() % 2 == 0
            and group >= 32 and group & (group - 1) == 0)


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    """Whether `device` is an sm_90 GPU (wgmma) and Triton has Gluon (`devmap.compat.gluon`)."""
    try:
        import devmap.compat.gluon  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def wgmma_decode_ptx(x: torch.Tensor, weight: FourBitWeight) -> str:
    """The PTX Hopper's kernel (`four_bit_products_wgmma`) makes the weights with, where `product` can run
    it for `x` (and `kernel_applies`): an sm_90 GPU, the values made from bit patterns (`decode_ptx`: x, scales and
    zeros in one dtype), groups of at most 128 and what TMA reads aligned to 16 bytes; else ""."""
    from .four_bit_products_kernel import decode_ptx

    if not (_hopper(x.device) and weight.span <= SPAN and (x.stride(0) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0 and weight.packed.stride(0) % 16 == 0 and weight.packed.data_ptr() % 16 == 0):
        return ""
    return decode_ptx(x.dtype, weight)


def kernel_table(weight: FourBitWeight, device: torch.device) -> torch.Tensor:
    """What the kernels' `CodeValues` argument gets: a table's `code_value_table`; for int4's code values, which they
    make without one, any tensor (the scales: nothing is made, nor read)."""
    return weight.scale if weight.affine else code_value_table(weight.code_values, device, weight.scale.dtype)


def product(x: torch.Tensor, weight: FourBitWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    out = four_bit_rows_product(flat, *weight.tensors, list(weight.code_values)).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


@torch.library.custom_op("devmap::four_bit_rows_product", mutates_args=())
def four_bit_rows_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                          code_values: Sequence[float]) -> torch.Tensor:
    """x (rows × in) · weightᵀ in x's dtype: the kernel (by `kernel_applies`) or the dequantized weight's product.
    An operator of its own, so that torch.compile calls it as it is: the block shape for the rows at hand is chosen
    at each call, never guarded on in a compiled step (one compile serves every batch size)."""
    weight = FourBitWeight(packed, scale, zero, tuple(code_values))
    if not kernel_applies(x, weight):
        return torch.mm(x, dequantize(weight, x.dtype).t())
    if x.shape[0] > TILED_ROWS:
        return torch.mm(x, dequantized(weight, x.dtype).t())
    ptx = wgmma_decode_ptx(x, weight) if x.shape[0] > DECODE_ROWS else ""
    if ptx:
        from .four_bit_products_wgmma import wgmma_product

        return wgmma_product(x, weight, ptx)
    return kernel_product(x, weight)


@four_bit_rows_product.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
      code_values: Sequence[float]) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


class BlockShape(NamedTuple):
    """How the rows kernel cuts a product: output columns per program, split-K parts of the inner dimension
    (`split_k`), Triton's warps and pipeline stages, rows per program (0: every row in one block)."""

    out: int
    splits: int
    warps: int = 4
    stages: int = 3
    rows: int = 0


def block_shape(rows: int, outs: int, groups: int, gpu: Card = HOPPER) -> BlockShape:
    """The rows kernel's cut, as a rule from the fastest of 24 shapes per product of a 13B layer at 1, 32, 64 and 256
    rows (H200), of 48 at 96, 160, 288 and 544 rows (H100) and of 48 at 16 and 32 rows (H200, weights made from bit
    patterns): every row in one block (each weight's value is computed once: a second block of rows computes them
    all again), of 64 output columns up to NARROW_ROWS, 128 (8 warps: the rows' inputs read once for twice the
    outputs) up to DECODE_ROWS, 64 up to WIDE_ROWS and 128 beyond, the inner dimension in the split-K parts that make
    the card's `programs` (two per SM; twice as many up to NARROW_ROWS), at most one part per group."""
    import triton

    out, warps = (64, 4) if rows <= NARROW_ROWS or DECODE_ROWS < rows <= WIDE_ROWS else (128, 8)
    programs = gpu.programs // triton.cdiv(outs, out)
    if rows <= NARROW_ROWS:
        return BlockShape(out, min(groups, 2 * max(1, programs)))
    return BlockShape(out, max(1, min(groups, programs)), warps)


def kernel_product(x: torch.Tensor, weight: FourBitWeight, shape: BlockShape | None = None) -> torch.Tensor:
    """x (rows × in) · weightᵀ (int4) through the rows kernel, cut as `shape` says (default: `block_shape`'s
    rule)."""
    import triton

    from .four_bit_products_kernel import four_bit_rows_kernel, decode_ptx

    rows, ins = x.shape
    outs, groups = weight.packed.shape[0], weight.scale.shape[1]
    shape = shape or block_shape(rows, outs, ins // weight.span, card(x.device))
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    parts = partial_sums(out, shape.splits)
    block_rows = shape.rows or max(16, triton.next_power_of_2(rows))
    ptx = decode_ptx(x.dtype, weight)
    table = kernel_table(weight, x.device)
    four_bit_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits, triton.cdiv(rows, block_rows))](
        x, weight.packed, weight.scale, zero_or_scale(weight), table, parts, rows, outs, ins, x.stride(0),
        weight.packed.stride(0), groups, outs, rows * outs, GROUP=weight.group, PAIRED=weight.paired,
        ZERO=weight.zero is not None, BLOCK_ROWS=block_rows, BLOCK_OUT=shape.out, SPLIT=shape.splits,
        PATTERN=bool(ptx), DECODE=ptx, TABLE=not weight.affine, num_warps=shape.warps, num_stages=shape.stages)
    add_partial_sums(parts, out, shape.splits)
    return out


def dequantized(weight: FourBitWeight, dtype: torch.dtype, block_out: int = 64) -> torch.Tensor:
    """The weight's values (outs × ins) in `dtype`, written by `four_bit_dequantize_kernel` (computed in float32)."""
    import triton

    from .four_bit_products_kernel import four_bit_dequantize_kernel

    outs, ins = weight.shape
    out = torch.empty((outs, ins), dtype=dtype, device=weight.packed.device)
    table = kernel_table(weight, out.device)
    four_bit_dequantize_kernel[(triton.cdiv(outs, block_out), ins // weight.span)](
        weight.packed, weight.scale, zero_or_scale(weight), table, out, outs, weight.packed.stride(0),
        weight.scale.shape[1], ins, GROUP=weight.group, PAIRED=weight.paired, ZERO=weight.zero is not None,
        BLOCK_OUT=block_out, TABLE=not weight.affine)
    return out


# each block shape (16 to 256 rows) with Triton's specializations of `rows` (1, multiples of 16, others), each of
# Hopper's tiles (64, 96, 128, 160, 192, 256 rows: `four_bit_products_wgmma.tile_rows`), and the dequantize kernel
PREPARED_ROWS = (1, 2, NARROW_ROWS, NARROW_ROWS + 1, DECODE_ROWS, DECODE_ROWS + 1, 64, 65, WIDE_ROWS, WIDE_ROWS + 1,
                 192, TILED_ROWS, TILED_ROWS + 1)


def prepare_kernels(weights: Iterable[FourBitWeight], dtype: torch.dtype) -> int:
    """Run the kernel once for each distinct weight shape and each of PREPARED_ROWS, so that Triton compiles every
    variant a step can use now (then caches it on disk) instead of in a service's first requests. Returns the
    products run: 0 where the kernel does not apply."""
    seen, runs = set(), 0
    with torch.no_grad():
        for weight in weights:
            key = (weight.shape, weight.group, weight.packed.device, tuple(weight.code_values))
            if key in seen:
                continue
            seen.add(key)
            for rows in PREPARED_ROWS:
                x = torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.packed.device)
                if kernel_applies(x, weight):
                    four_bit_rows_product(x, *weight.tensors, list(weight.code_values))
                    runs += 1
    return runs
