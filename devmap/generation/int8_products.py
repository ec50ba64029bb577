"""Matrix products with int8 weights that carry one scale per output row (what `--quantize int8` stores), as decode
steps and prefills run them. torchao's product (`mm(x, w.to(x.dtype)) * scale`) first writes a full-precision copy of
the weight: at a decode step's few rows that is about 2.5× the bytes of the full-precision product itself, and at a
prefill's 2,048 rows it still costs 1.6× the full-precision product (H100). On CUDA, in half precision, Triton
kernels read the int8 weights and convert them in registers (`int8_products_kernel`): up to DECODE_ROWS rows a
decode kernel, up to KERNEL_ROWS (a prefill pack) a tiled one. Anything else (more rows, CPU, float32) runs
torchao's formula, with its numbers.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

DECODE_ROWS = 64  # rows (tokens) up to which the decode kernel runs (all rows in one block)
SMALL_TILE_ROWS = 256  # rows up to which the tiled kernel's tiles are 64 rows high (256 beyond)
KERNEL_ROWS = 2048  # rows up to which the tiled kernel runs (`joins.PACK_TOKENS`); beyond, torchao's formula
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def kernel_applies(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `int8_product` runs a kernel for `x` (rows × in): CUDA, half precision, at most KERNEL_ROWS rows,
    contiguous int8 weights and float scales."""
    return (x.is_cuda and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS
            and x.stride(1) == 1 and qdata.dtype == torch.int8 and qdata.is_contiguous() and scale.is_contiguous()
            and scale.dtype.is_floating_point)


def int8_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · (qdata (out × in, int8) × scale (out or out × 1))ᵀ (+ bias), in x's dtype."""
    out = int8_rows_product(x.reshape(-1, x.shape[-1]), qdata, scale).reshape(*x.shape[:-1], qdata.shape[0])
    if bias is not None:
        out = out + bias
    return out


@torch.library.custom_op("devmap::int8_rows_product", mutates_args=())
def int8_rows_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (rows × in) · (qdata × scale)ᵀ in x's dtype, the kernel or torchao's formula by `kernel_applies`. An
    operator of its own, so that torch.compile calls it as it is: which product runs, and the kernel's block shape
    for the rows at hand, are decided at each call, never guarded on in a compiled step (one compile serves every
    batch size)."""
    return kernel_product(x, qdata, scale) if kernel_applies(x, qdata, scale) else torchao_formula(x, qdata, scale)


def torchao_formula(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torchao's per-row int8 weight-only product, operation for operation (its eager path, with its numbers): a
    full-precision copy of the weight, then the product and the scales."""
    out = torch.mm(x, qdata.t().to(x.dtype))
    return (out * scale.to(out.dtype).flatten()).to(x.dtype)


@int8_rows_product.register_fake
def _(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qdata.shape[0]))


# every block shape, and Triton's specializations of `rows` (1, multiples of 16): decode's, then each tile height's
PREPARED_ROWS = (1, 2, 16, 17, 32, 33, DECODE_ROWS, DECODE_ROWS + 16, DECODE_ROWS + 17, SMALL_TILE_ROWS + 16,
                 SMALL_TILE_ROWS + 17)


def prepare_kernels(weights: Iterable[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> int:
    """Run the kernel once for each distinct int8 weight (data, scales) shape and each of PREPARED_ROWS, so that
    Triton compiles every variant a decode step can use now (then caches it on disk) instead of in a service's
    first requests. Returns the products run: 0 where the kernel does not apply (CPU, float32)."""
    seen, runs = set(), 0
    with torch.no_grad():
        for qdata, scale in weights:
            key = (tuple(qdata.shape), qdata.device)
            if key in seen:
                continue
            seen.add(key)
            for rows in PREPARED_ROWS:
                x = torch.zeros(rows, qdata.shape[1], dtype=dtype, device=qdata.device)
                if kernel_applies(x, qdata, scale):
                    kernel_product(x, qdata, scale)
                    runs += 1
    return runs


class BlockShape(NamedTuple):
    """How a kernel cuts a product: output columns per program, inner-dimension block, shares of the inner
    dimension (added in a fixed order by a second kernel), Triton's warps and pipeline stages, and rows per program:
    0 for the decode kernel (every row in one block), else the prefill kernel's tile height (no shares), with its
    weights as the tile product's first operand or not."""

    out: int
    inner: int
    splits: int
    warps: int = 4
    stages: int = 3
    rows: int = 0
    weights_first: bool = False


def block_shape(rows: int, outs: int) -> BlockShape:
    """The block shape for a product of `rows` rows: up to DECODE_ROWS, the fastest of 36 shapes timed on an H100
    for LLaMA-2-13B's products at 2-64 rows (`benchmarks/probes/int8_matmul.py`), as a rule. Wide products (qkv,
    gate_up) have programs enough; narrow ones (o, down: fewer output columns than 8,192) split their inner
    dimension so that every SM has weights to read. Beyond, the tiled kernel: the fastest of 24 tiles timed on an
    H100 for the same products at 136-2,048 rows, 64 rows a tile up to 256 rows, then 256 with the weights as the
    first operand (over a 13B layer torchao's formula took 1.12× as long at 2,048 rows, 1.9× at 512)."""
    if rows > DECODE_ROWS:
        return BlockShape(128, 64, 1, 4, 4, rows=64) if rows <= SMALL_TILE_ROWS else \
            BlockShape(128, 64, 1, 8, 3, rows=256, weights_first=True)
    if outs >= 8192:
        return BlockShape(32, 128, 1) if rows <= 16 else BlockShape(128, 256, 1) if rows <= 32 else \
            BlockShape(128, 128, 1)
    return BlockShape(32, 128, 4) if rows <= 16 else BlockShape(64, 128, 8) if rows <= 32 else \
        BlockShape(32, 128, 2)


def kernel_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                   shape: BlockShape | None = None) -> torch.Tensor:
    """x (rows × in) · (qdata × scale)ᵀ through a Triton kernel, cut as `shape` says (default: `block_shape`'s
    rule): the decode kernel where `shape.rows` is 0 (then rows ≤ DECODE_ROWS), else the prefill kernel."""
    import triton

    from .int8_products_kernel import add_shares, int8_rows_kernel, int8_tiles_kernel

    rows, ins = x.shape
    outs = qdata.shape[0]
    shape = shape or block_shape(rows, outs)
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    if shape.rows:
        int8_tiles_kernel[(triton.cdiv(rows, shape.rows), triton.cdiv(outs, shape.out))](
            x, qdata, scale, out, rows, outs, ins, x.stride(0), qdata.stride(0), outs,
            BLOCK_ROWS=shape.rows, BLOCK_OUT=shape.out, BLOCK_IN=shape.inner, WEIGHTS_FIRST=shape.weights_first,
            EVEN_IN=ins % shape.inner == 0, num_warps=shape.warps, num_stages=shape.stages)
        return out
    shares = out if shape.splits == 1 else torch.empty((shape.splits, rows, outs), dtype=torch.float32,
                                                       device=x.device)
    int8_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits)](
        x, qdata, scale, shares, rows, outs, ins, x.stride(0), qdata.stride(0), outs, rows * outs,
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_OUT=shape.out, BLOCK_IN=shape.inner,
        SPLIT=shape.splits, num_warps=shape.warps, num_stages=shape.stages)
    if shape.splits > 1:
        add_shares[(triton.cdiv(rows * outs, 1024),)](shares, out, rows * outs, SPLIT=shape.splits, BLOCK=1024)
    return out
