"""Hopper's (sm_90) kernel for 4-bit products of a few tiles of rows (more than `four_bit_products.DECODE_ROWS`,
up to its TILED_ROWS: steps that carry prompts), written in Gluon (`devmap.compat.gluon`) because it needs what
Triton's `tl.dot` does not give: the tensor cores' asynchronous products (wgmma) with the weights as the first
operand in registers, so that the next group's weights are made while the tensor cores multiply this group's.

Per program: a block of BLOCK_OUT output columns (a warpgroup per 64), a tile of up to 256 rows and a share of the
inner dimension (shares added by `int8_products_kernel.add_shares`). A ring of STAGES stages in shared memory takes
each group's inputs (two halves, the group's two halves of a byte) and 4-bit bytes by TMA, each stage with its
mbarrier; a group's weights are read from its stage into the first operand's registers and made by the same PTX as
the rows kernel's (`four_bit_products_kernel.levels_ptx`: int4's bit patterns or nf4's table), the products issued
asynchronously, and the stage of the group before refilled once every warpgroup is past its products. Against the
rows kernel (whose `tl.dot` waits for each product before the next weights are made) over a 13B layer's four products,
H200, at the rule's shapes: 0.79-0.90× its time at 64-256 rows (int4), 0.63-0.91× (nf4); a step of 32 rows
carrying 63 / 127 prompt tokens (13B, int4) 12.96 / 18.22 ms against 15.03 / 22.66. At 32 rows and fewer the rows
kernel stays faster (nf4, 32 rows: 1.2× the rows kernel's time), and past 256 rows values + cuBLAS (a 256-row tile and
a tile of the rest made every weight twice: no faster at 288 rows, 1.2× at 544)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton

from ..compat.gluon import (TensorDescriptor, cta_barrier, descriptor_type, fence_async_shared, gl, gluon, mbarrier,
                            sm90_compile, tma_load, warpgroup_mma, warpgroup_mma_wait)
from .int8_products import PROGRAMS
from .int8_products_kernel import add_shares


@gluon.jit
def _weights(packed, scale, zero, LEVELS: gl.constexpr):
    """The low- and high-half weights of `packed` (uint8, the first operand's layout) in the scales' dtype."""
    scales, levels = gl.broadcast(scale[:, None], packed)
    zeros, _ = gl.broadcast(zero[:, None], packed)
    return gl.inline_asm_elementwise(LEVELS, "=r,=r,=r,=r,r,r,r,r,r", [levels, scales, zeros],
                                     dtype=(scale.dtype, scale.dtype), is_pure=True, pack=4)


@gluon.jit(do_not_specialize=["rows", "out_split", "splits"])  # one compile per tile, whatever the rows
def wgmma_rows_kernel(x_desc, w_desc, Scale, Zero, Out, rows, outs, ins, scale_row, out_row, out_split, splits,
                      GROUP: gl.constexpr, STAGES: gl.constexpr, LEVELS: gl.constexpr, num_warps: gl.constexpr):
    """Out[s, rows, outs] = X · Wᵀ over every `splits`-th group from group s on (program (o, s, r)), as
    `four_bit_products_kernel.four_bit_rows_kernel`, X and W's bytes read through `x_desc` ([tile rows, GROUP / 2]
    of X) and `w_desc` ([BLOCK_OUT, GROUP / 2] bytes)."""
    BLOCK_ROWS: gl.constexpr = x_desc.block_type.shape[0]
    HALF: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_OUT: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_ROWS, 16])
    first: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    split = gl.program_id(1)
    row0 = gl.program_id(2) * BLOCK_ROWS
    out0 = gl.program_id(0) * BLOCK_OUT
    steps = (ins // GROUP - split + splits - 1) // splits

    x_low = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_ROWS, HALF], x_desc.layout)
    x_high = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_ROWS, HALF], x_desc.layout)
    w_bytes = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_OUT, HALF], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    NBYTES: gl.constexpr = 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for s in gl.static_range(STAGES - 1):
        group = split + s * splits
        mbarrier.expect(ready.index(s), NBYTES, pred=s < steps)
        tma_load(x_desc, [row0, group * GROUP], ready.index(s), x_low.index(s), pred=s < steps)
        tma_load(x_desc, [row0, group * GROUP + HALF], ready.index(s), x_high.index(s), pred=s < steps)
        tma_load(w_desc, [out0, group * HALF], ready.index(s), w_bytes.index(s), pred=s < steps)

    out = out0 + gl.arange(0, BLOCK_OUT, gl.SliceLayout(1, first))
    keep_outs = out < outs
    scales = Scale + out * scale_row
    zeros = Zero + out * scale_row
    scale = gl.load(scales + split, mask=keep_outs, other=0.0)
    zero = gl.load(zeros + split, mask=keep_outs, other=0.0)
    mbarrier.wait(ready.index(0), 0)
    low, high = _weights(w_bytes.index(0).load(first), scale, zero, LEVELS)
    # the weights of the products in flight, kept alive until they are waited for
    busy_low = gl.zeros([BLOCK_OUT, HALF], dtype, first)
    busy_high = gl.zeros([BLOCK_OUT, HALF], dtype, first)
    acc = gl.zeros([BLOCK_OUT, BLOCK_ROWS], gl.float32, mma)
    for step in range(steps):
        following = step + 1
        more = following < steps
        scale = gl.load(scales + split + following * splits, mask=keep_outs & more, other=0.0)
        zero = gl.load(zeros + split + following * splits, mask=keep_outs & more, other=0.0)
        here = step % STAGES
        acc = warpgroup_mma(low, x_low.index(here).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(high, x_high.index(here).permute((1, 0)), acc, is_async=True)
        acc, busy_low, busy_high = warpgroup_mma_wait(num_outstanding=2, deps=(acc, busy_low, busy_high))
        busy_low = low
        busy_high = high
        cta_barrier()  # every warpgroup is past the previous step's products: its stage takes a later group
        fence_async_shared()
        later = step - 1 + STAGES
        stage = later % STAGES
        group = split + later * splits
        mbarrier.expect(ready.index(stage), NBYTES, pred=later < steps)
        tma_load(x_desc, [row0, group * GROUP], ready.index(stage), x_low.index(stage), pred=later < steps)
        tma_load(x_desc, [row0, group * GROUP + HALF], ready.index(stage), x_high.index(stage), pred=later < steps)
        tma_load(w_desc, [out0, group * HALF], ready.index(stage), w_bytes.index(stage), pred=later < steps)
        mbarrier.wait(ready.index(following % STAGES), (following // STAGES) & 1, pred=more)
        low, high = _weights(w_bytes.index(following % STAGES).load(first), scale, zero, LEVELS)
    acc, busy_low, busy_high = warpgroup_mma_wait(num_outstanding=0, deps=(acc, busy_low, busy_high))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    row = row0 + gl.arange(0, BLOCK_ROWS, gl.SliceLayout(0, mma))
    col = out0 + gl.arange(0, BLOCK_OUT, gl.SliceLayout(1, mma))
    gl.store(Out + split * out_split + row[None, :] * out_row + col[:, None], acc.to(Out.dtype.element_ty),
             mask=(row[None, :] < rows) & (col[:, None] < outs))


class WgmmaShape(NamedTuple):
    """How the kernel cuts a product: rows per tile (64, 128 or 256), output columns per program (64 per
    warpgroup), stages of the ring, shares of the inner dimension."""

    rows: int
    out: int
    stages: int
    splits: int


SHARED = 220 * 1024  # shared memory the ring may take (an H100's or H200's SM has 227 KiB)
SPREAD = 96  # programs from which a product is not cut along its inner dimension (~3/4 of an H200's 132 SMs)


def stage_bytes(tile: int, out: int, group: int) -> int:
    """Shared memory one stage of the ring takes: a group's inputs for `tile` rows (two halves, 2 bytes each) and
    its 4-bit bytes for `out` output columns."""
    return 2 * tile * group + out * group // 2


def wgmma_shape(rows: int, outs: int, groups: int, group: int) -> WgmmaShape:
    """The rule, from the fastest of 8-14 shapes per product of a 13B layer at 64-256 rows (H200, int4 and nf4):
    every row in one tile of 64, 128 or 256; 64 output columns (one warpgroup) for tiles of 64, else 128 (two
    warpgroups reading one tile of rows); 3 stages, 4 for tiles of 256 rows where they fit (nf4's groups of 64);
    the inner dimension in shares only where the blocks are fewer than SPREAD (o and down: the shares that make
    PROGRAMS programs; q/k/v and gate/up were 15-25% slower in two shares)."""
    tile = min(256, max(64, triton.next_power_of_2(rows)))
    out = 64 if tile == 64 else 128
    stages = min(4, SHARED // stage_bytes(tile, out, group)) if tile == 256 else 3
    programs = triton.cdiv(outs, out) * triton.cdiv(rows, tile)
    splits = 1 if programs >= SPREAD else max(1, min(groups, PROGRAMS // programs))
    return WgmmaShape(tile, out, stages, splits)


def _layouts(dtype: torch.dtype, shape: WgmmaShape, half: int) -> tuple[Any, Any]:
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([shape.rows, half], element),
            gl.NVMMASharedLayout.get_default_for([shape.out, half], gl.uint8))


def wgmma_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: str,
                  shape: WgmmaShape | None = None) -> torch.Tensor:
    """x (rows × in) · weightᵀ through the kernel, the weight a `four_bit_products.FourBitWeight`'s tensors made by
    `levels` (its `levels_ptx`) where `four_bit_products.wgmma_levels` gives them, cut as `shape` says (default:
    `wgmma_shape`'s rule)."""
    rows, ins = x.shape
    outs, groups = packed.shape[0], scale.shape[1]
    group = ins // groups
    half = group // 2
    shape = shape or wgmma_shape(rows, outs, groups, group)
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    shares = out if shape.splits == 1 else torch.empty((shape.splits, rows, outs), dtype=torch.float32,
                                                       device=x.device)
    x_layout, w_layout = _layouts(x.dtype, shape, half)
    x_desc = TensorDescriptor(x, [rows, ins], [x.stride(0), 1], [shape.rows, half], x_layout)
    w_desc = TensorDescriptor(packed, [outs, ins // 2], [packed.stride(0), 1], [shape.out, half], w_layout)
    wgmma_rows_kernel[(triton.cdiv(outs, shape.out), shape.splits, triton.cdiv(rows, shape.rows))](
        x_desc, w_desc, scale, zero, shares, rows, outs, ins, groups, outs, rows * outs, shape.splits, GROUP=group,
        STAGES=shape.stages, LEVELS=levels, num_warps=shape.out // 16)
    if shape.splits > 1:
        add_shares[(triton.cdiv(rows * outs, 1024),)](shares, out, rows * outs, SPLIT=shape.splits, BLOCK=1024)
    return out


def compile_sm90(shape: WgmmaShape, group: int, dtype: torch.dtype, levels: str) -> Any:
    """The kernel for `shape`, groups of `group` and `levels`' PTX compiled for sm_90 (no GPU needed)."""
    half = group // 2
    x_layout, w_layout = _layouts(dtype, shape, half)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = {"x_desc": descriptor_type(name, [shape.rows, half], x_layout),
                 "w_desc": descriptor_type("u8", [shape.out, half], w_layout), "Scale": f"*{name}",
                 "Zero": f"*{name}", "Out": "*fp32", "rows": "i32", "outs": "i32", "ins": "i32", "scale_row": "i32",
                 "out_row": "i32", "out_split": "i32", "splits": "i32", "GROUP": "constexpr", "STAGES": "constexpr",
                 "LEVELS": "constexpr", "num_warps": "constexpr"}
    constants = {"GROUP": group, "STAGES": shape.stages, "LEVELS": levels, "num_warps": shape.out // 16}
    return sm90_compile(wgmma_rows_kernel, signature, constants, ("Scale", "Zero", "Out", "ins", "outs", "out_row"),
                        shape.out // 16)
