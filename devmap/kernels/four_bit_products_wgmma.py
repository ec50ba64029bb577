"""Hopper's (sm_90) kernel for 4-bit products of a few tiles of rows (more than `four_bit_products.DECODE_ROWS`,
up to its TILED_ROWS: steps that carry prompts), written in Gluon (`devmap.compat.gluon`) because it needs what
Triton's `tl.dot` does not give: the tensor cores' asynchronous products (wgmma) with the weights as the first
operand in registers, so that the next span's weights are made while the tensor cores multiply this span's.

Per program: a block of BLOCK_OUT output columns (a warpgroup per 64), a tile of up to 256 rows and a part of the
inner dimension (a split-K part; `split_k` adds them). A tile is a power of two of rows or two parts
(`tile_rows`: 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64), so that a step of 32 rows carrying a pack of 64 or 128
prompt tokens computes no padding row; the tensor cores multiply both parts by the same weights in the registers. A
ring of STAGES stages in shared memory takes each span's inputs (two halves, the span's two halves of a byte) and
4-bit bytes by TMA, each stage with its mbarrier; a span's weights are read from its stage into the first operand's
registers and made by the same PTX as the rows kernel's (`four_bit_products_kernel.decode_ptx`: int4's bit patterns or
nf4's table), the products issued asynchronously, and the stage of the span before refilled once every warpgroup is
past its products. At 32 rows and fewer the rows kernel stays, and past 256 rows the dequantize kernel + cuBLAS
(docs/kernels.md has the measurements)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton

from ..compat.gluon import (TensorDescriptor, cta_barrier, descriptor_type, fence_async_shared, gl, gluon, mbarrier,
                            sm90_compile, tma_load, warpgroup_mma, warpgroup_mma_wait)
from .four_bit_layout import FourBitWeight, zero_or_scale
from .four_bit_products_kernel import OPERANDS
from .card import HOPPER, Card, card
from .split_k import add_partial_sums, partial_sums


@gluon.jit
def _span_scales(scales, zeros, span, keep, PAIRED: gl.constexpr, ZERO: gl.constexpr):
    """The scale and zero (each output's) of the group of a span's low halves, then of its high halves' (the same
    group unless PAIRED: the span's two groups); zeros 0 without ZERO (none read)."""
    low = span * 2 if PAIRED else span
    scale = gl.load(scales + low, mask=keep, other=0.0)
    zero = gl.load(zeros + low, mask=keep, other=0.0) if ZERO else gl.zeros_like(scale)
    high_scale, high_zero = scale, zero
    if PAIRED:
        high_scale = gl.load(scales + low + 1, mask=keep, other=0.0)
        high_zero = gl.load(zeros + low + 1, mask=keep, other=0.0) if ZERO else zero
    return scale, zero, high_scale, high_zero


@gluon.jit
def _weights(packed, scale, zero, high_scale, high_zero, DECODE: gl.constexpr):
    """The low- and high-half weights of `packed` (uint8, the first operand's layout) in the scales' dtype."""
    scales, codes = gl.broadcast(scale[:, None], packed)
    zeros, _ = gl.broadcast(zero[:, None], packed)
    high_scales, _ = gl.broadcast(high_scale[:, None], packed)
    high_zeros, _ = gl.broadcast(high_zero[:, None], packed)
    return gl.inline_asm_elementwise(DECODE, OPERANDS, [codes, scales, zeros, high_scales, high_zeros],
                                     dtype=(scale.dtype, scale.dtype), is_pure=True, pack=4)


@gluon.jit
def _load_x(x_desc, tail_desc, x_low, x_high, tail_low, tail_high, ready, stage, row0, k, pred,
            HEAD: gl.constexpr, TAIL: gl.constexpr):
    """A group's two halves of X's tile (head rows, then tail rows if any) into `stage` of the ring."""
    HALF: gl.constexpr = x_desc.block_type.shape[1]
    tma_load(x_desc, [row0, k], ready, x_low.index(stage), pred=pred)
    tma_load(x_desc, [row0, k + HALF], ready, x_high.index(stage), pred=pred)
    if TAIL > 0:
        tma_load(tail_desc, [row0 + HEAD, k], ready, tail_low.index(stage), pred=pred)
        tma_load(tail_desc, [row0 + HEAD, k + HALF], ready, tail_high.index(stage), pred=pred)


@gluon.jit
def _store(acc, Out, rows, outs, row0, out0, out_row, layout: gl.constexpr):
    """One part of the tile's rows (its accumulator in `layout`) into Out (this program's share)."""
    row = row0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, layout))
    col = out0 + gl.arange(0, acc.shape[0], gl.SliceLayout(1, layout))
    gl.store(Out + row[None, :] * out_row + col[:, None], acc.to(Out.dtype.element_ty),
             mask=(row[None, :] < rows) & (col[:, None] < outs))


@gluon.jit(do_not_specialize=["rows", "out_split", "splits"])  # one compile per tile, whatever the rows
def wgmma_rows_kernel(x_desc, tail_desc, w_desc, Scale, Zero, Out, rows, outs, ins, scale_row, out_row, out_split,
                      splits, PAIRED: gl.constexpr, ZERO: gl.constexpr, STAGES: gl.constexpr, DECODE: gl.constexpr,
                      TAIL: gl.constexpr, num_warps: gl.constexpr):
    """Out[s, rows, outs] = X · Wᵀ over every `splits`-th span from span s on (program (o, s, r)), as
    `four_bit_products_kernel.four_bit_rows_kernel` (a span a group, or with PAIRED two; zeros read only with ZERO), X
    and W's bytes read through `x_desc` ([head rows, half a span] of X), with TAIL > 0 `tail_desc` ([TAIL rows, half a
    span]: the tile's rows past the head, a power of two below it), and `w_desc` ([BLOCK_OUT, half a span] bytes). The
    tensor cores multiply head and tail by the same weights in the registers, in instructions of the tail's width (the
    first operand's layout is the products')."""
    HEAD: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_ROWS: gl.constexpr = HEAD + TAIL
    HALF: gl.constexpr = x_desc.block_type.shape[1]
    SPAN: gl.constexpr = 2 * HALF
    BLOCK_OUT: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, TAIL if TAIL > 0 else HEAD, 16])
    first: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    split = gl.program_id(1)
    row0 = gl.program_id(2) * BLOCK_ROWS
    out0 = gl.program_id(0) * BLOCK_OUT
    steps = (ins // SPAN - split + splits - 1) // splits

    x_low = gl.allocate_shared_memory(dtype, [STAGES, HEAD, HALF], x_desc.layout)
    x_high = gl.allocate_shared_memory(dtype, [STAGES, HEAD, HALF], x_desc.layout)
    tail_low = x_low  # no tail: never read
    tail_high = x_high
    if TAIL > 0:
        tail_low = gl.allocate_shared_memory(dtype, [STAGES, TAIL, HALF], tail_desc.layout)
        tail_high = gl.allocate_shared_memory(dtype, [STAGES, TAIL, HALF], tail_desc.layout)
    w_bytes = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_OUT, HALF], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    NBYTES: gl.constexpr = 2 * BLOCK_ROWS * HALF * x_desc.dtype.primitive_bitwidth // 8 + w_desc.block_type.nbytes
    for s in gl.static_range(STAGES - 1):
        span = split + s * splits
        mbarrier.expect(ready.index(s), NBYTES, pred=s < steps)
        _load_x(x_desc, tail_desc, x_low, x_high, tail_low, tail_high, ready.index(s), s, row0, span * SPAN,
                s < steps, HEAD, TAIL)
        tma_load(w_desc, [out0, span * HALF], ready.index(s), w_bytes.index(s), pred=s < steps)

    out = out0 + gl.arange(0, BLOCK_OUT, gl.SliceLayout(1, first))
    keep_outs = out < outs
    scales = Scale + out * scale_row
    zeros = Zero + out * scale_row
    scale, zero, high_scale, high_zero = _span_scales(scales, zeros, split, keep_outs, PAIRED, ZERO)
    mbarrier.wait(ready.index(0), 0)
    low, high = _weights(w_bytes.index(0).load(first), scale, zero, high_scale, high_zero, DECODE)
    # the weights of the products in flight, kept alive until they are waited for
    busy_low = gl.zeros([BLOCK_OUT, HALF], dtype, first)
    busy_high = gl.zeros([BLOCK_OUT, HALF], dtype, first)
    acc = gl.zeros([BLOCK_OUT, HEAD], gl.float32, mma)
    tail = gl.zeros([BLOCK_OUT, TAIL if TAIL > 0 else 8], gl.float32, mma)
    for step in range(steps):
        following = step + 1
        more = following < steps
        scale, zero, high_scale, high_zero = _span_scales(scales, zeros, split + following * splits,
                                                          keep_outs & more, PAIRED, ZERO)
        here = step % STAGES
        acc = warpgroup_mma(low, x_low.index(here).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(high, x_high.index(here).permute((1, 0)), acc, is_async=True)
        if TAIL > 0:
            tail = warpgroup_mma(low, tail_low.index(here).permute((1, 0)), tail, is_async=True)
            tail = warpgroup_mma(high, tail_high.index(here).permute((1, 0)), tail, is_async=True)
            acc, tail, busy_low, busy_high = warpgroup_mma_wait(num_outstanding=4,
                                                                deps=(acc, tail, busy_low, busy_high))
        else:
            acc, busy_low, busy_high = warpgroup_mma_wait(num_outstanding=2, deps=(acc, busy_low, busy_high))
        busy_low = low
        busy_high = high
        cta_barrier()  # every warpgroup is past the previous step's products: its stage takes a later group
        fence_async_shared()
        later = step - 1 + STAGES
        stage = later % STAGES
        span = split + later * splits
        mbarrier.expect(ready.index(stage), NBYTES, pred=later < steps)
        _load_x(x_desc, tail_desc, x_low, x_high, tail_low, tail_high, ready.index(stage), stage, row0,
                span * SPAN, later < steps, HEAD, TAIL)
        tma_load(w_desc, [out0, span * HALF], ready.index(stage), w_bytes.index(stage), pred=later < steps)
        mbarrier.wait(ready.index(following % STAGES), (following // STAGES) & 1, pred=more)
        low, high = _weights(w_bytes.index(following % STAGES).load(first), scale, zero, high_scale, high_zero,
                             DECODE)
    acc, tail, busy_low, busy_high = warpgroup_mma_wait(num_outstanding=0, deps=(acc, tail, busy_low, busy_high))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    _store(acc, Out + split * out_split, rows, outs, row0, out0, out_row, mma)
    if TAIL > 0:
        _store(tail, Out + split * out_split, rows, outs, row0 + HEAD, out0, out_row, mma)


class WgmmaShape(NamedTuple):
    """How the kernel cuts a product: rows per tile (64 to 256), output columns per program (64 per warpgroup),
    stages of the ring, split-K parts of the inner dimension, and the tile's rows past its head (a power of two) that
    make a second part of it (0: none; a tile of 160 rows is 128 + 32)."""

    rows: int
    out: int
    stages: int
    splits: int
    tail: int = 0


def stage_bytes(tile: int, out: int, span: int) -> int:
    """Shared memory one stage of the ring takes: a span's inputs for `tile` rows (two halves, 2 bytes each) and
    its 4-bit bytes for `out` output columns."""
    return 2 * tile * span + out * span // 2


def tile_rows(rows: int) -> tuple[int, int]:
    """(tile, tail) for `rows` rows: rows up to 64 in one of 64, else rounded up to a multiple of 32 and cut in a
    power of two and a smaller one (96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64), or the next power of two where
    the rest is none or not one (224 -> 256: a third part measured slower than the 256-row tile)."""
    if rows <= 64:
        return 64, 0
    whole = min(256, triton.cdiv(rows, 32) * 32)
    head = 1 << (whole.bit_length() - 1)
    tail = whole - head
    if tail & (tail - 1):
        return min(256, 2 * head), 0
    return whole, tail


def wgmma_shape(rows: int, outs: int, spans: int, span: int, table: bool = False, gpu: Card = HOPPER) -> WgmmaShape:
    """The rule, from the fastest of 8-16 shapes per product of a 13B layer at 64-256 rows (H200, int4 and nf4):
    every row in one tile (`tile_rows`: fewer than 32 rows past the last, or 64 or 256 rows); 64 output columns (one
    warpgroup) for tiles of 64 and 96 rows and for int4's (not a `table`'s) of 128 (two programs per SM overlap each
    other's weights and products; nf4's table, more work per weight, gained nothing there), else 128 (two warpgroups
    reading one tile of rows); 3 stages, for tiles of 256 rows
    as many as fit the card's `ring_bytes` up to 4 (2 for spans of 128 weights); the inner dimension in split-K
    parts only where the blocks are fewer than the card's `spread` (o and down: the parts that make its `programs`;
    q/k/v and gate/up were slower in two parts). nf4's shapes were timed while its spans were single groups of 64
    weights, not again since; the timings are in docs/kernels.md."""
    tile, tail = tile_rows(rows)
    out = 64 if tile <= 96 or (tile == 128 and not table) else 128
    stages = min(4, gpu.ring_bytes // stage_bytes(tile, out, span)) if tile == 256 else 3
    programs = triton.cdiv(outs, out) * triton.cdiv(rows, tile)
    splits = 1 if programs >= gpu.spread else max(1, min(spans, gpu.programs // programs))
    return WgmmaShape(tile, out, stages, splits, tail)


def _layouts(dtype: torch.dtype, shape: WgmmaShape, half: int) -> tuple[Any, Any, Any]:
    """The shared layouts of the head's inputs, the tail's (the head's where there is none) and the 4-bit bytes."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([shape.rows - shape.tail, half], element),
            gl.NVMMASharedLayout.get_default_for([shape.tail or shape.rows, half], element),
            gl.NVMMASharedLayout.get_default_for([shape.out, half], gl.uint8))


def wgmma_product(x: torch.Tensor, weight: FourBitWeight, decode: str,
                  shape: WgmmaShape | None = None) -> torch.Tensor:
    """x (rows × in) · weightᵀ through the kernel, the weight made by the PTX `decode` (its `decode_ptx`: a table's or
    int4's) where `four_bit_products.wgmma_decode_ptx` gives them, cut as `shape` says (default: `wgmma_shape`'s
    rule)."""
    rows, ins = x.shape
    packed, span = weight.packed, weight.span
    outs, groups = packed.shape[0], weight.scale.shape[1]
    half = span // 2
    shape = shape or wgmma_shape(rows, outs, ins // span, span, not weight.affine, card(x.device))
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    parts = partial_sums(out, shape.splits)
    head_layout, tail_layout, w_layout = _layouts(x.dtype, shape, half)
    x_desc = TensorDescriptor(x, [rows, ins], [x.stride(0), 1], [shape.rows - shape.tail, half], head_layout)
    tail_desc = TensorDescriptor(x, [rows, ins], [x.stride(0), 1], [shape.tail, half], tail_layout) \
        if shape.tail else x_desc
    w_desc = TensorDescriptor(packed, [outs, ins // 2], [packed.stride(0), 1], [shape.out, half], w_layout)
    wgmma_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits, triton.cdiv(rows, shape.rows))](
        x_desc, tail_desc, w_desc, weight.scale, zero_or_scale(weight), parts, rows, outs, ins, groups, outs,
        rows * outs, shape.splits, PAIRED=weight.paired, ZERO=weight.zero is not None, STAGES=shape.stages,
        DECODE=decode, TAIL=shape.tail, num_warps=shape.out // 16)
    add_partial_sums(parts, out, shape.splits)
    return out


def compile_sm90(shape: WgmmaShape, span: int, dtype: torch.dtype, decode: str, paired: bool = False,
                 zero: bool = True) -> Any:
    """The kernel for `shape`, spans of `span` weights (two groups each where `paired`), zeros read or not, and
    `decode`'s PTX compiled for sm_90 (no GPU needed)."""
    half = span // 2
    head_layout, tail_layout, w_layout = _layouts(dtype, shape, half)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = {"x_desc": descriptor_type(name, [shape.rows - shape.tail, half], head_layout),
                 "tail_desc": descriptor_type(name, [shape.tail or shape.rows, half], tail_layout),
                 "w_desc": descriptor_type("u8", [shape.out, half], w_layout), "Scale": f"*{name}",
                 "Zero": f"*{name}", "Out": "*fp32", "rows": "i32", "outs": "i32", "ins": "i32", "scale_row": "i32",
                 "out_row": "i32", "out_split": "i32", "splits": "i32", "PAIRED": "constexpr", "ZERO": "constexpr",
                 "STAGES": "constexpr", "DECODE": "constexpr", "TAIL": "constexpr", "num_warps": "constexpr"}
    constants = {"PAIRED": paired, "ZERO": zero, "STAGES": shape.stages, "DECODE": decode, "TAIL": shape.tail,
                 "num_warps": shape.out // 16}
    return sm90_compile(wgmma_rows_kernel, signature, constants, ("Scale", "Zero", "Out", "ins", "outs", "out_row"),
                        shape.out // 16)
