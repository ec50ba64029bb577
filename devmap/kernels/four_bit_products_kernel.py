"""The Triton kernels behind `four_bit_products.product` (imported only where they run: Triton comes with
torch's CUDA wheels), over devmap's 4-bit layout: per span of an output row's weights (a group of GROUP weights, or
with PAIRED two), a byte per two weights, byte j holding weight j in its low half and weight SPAN / 2 + j in its high
half, so that both halves meet contiguous inputs (no shuffle in registers).

- `four_bit_rows_kernel` (up to a few tiles of rows): one program per block of output columns, split-K part of the
  inner dimension and block of rows (a decode step's rows are one block: each weight is read once), each weight's
  value made in registers and multiplied on tensor cores (`split_k` adds the parts). On CUDA the values come from bit
  patterns (`decode_ptx`): a code set into a half-precision mantissa, (q - 8) · scale + zero in one fused
  multiply-add, rounded once, and no conversion from integer to float (with one per weight the kernel was bound by
  issuing instructions, not by reading the weights: docs/kernels.md). Elsewhere (Triton's interpreter) in float32,
  then rounded, as tinygemm.
- `four_bit_dequantize_kernel` (more rows): the weight's values written out in half
  precision, one program per block of output columns and group, for a full-precision product (cuBLAS) to read."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _span_groups(span, PAIRED: tl.constexpr):
    """The groups of a span's low halves and of its high halves: the span's own group twice, or with PAIRED its
    two."""
    low = span * 2 if PAIRED else span
    return low, (low + 1 if PAIRED else low)


@triton.jit
def _half_values(q, Scale, Zero, CodeValues, out, scale_row, group, keep_outs, TABLE: tl.constexpr, ZERO: tl.constexpr):
    """The weights (float32) that codes `q` (outputs `out` × half a span) of `group` stand for: value(q) · scale +
    zero, the group's scale and zero of each output (without ZERO none: 0); value(q) = q - 8 (int4), or with TABLE
    CodeValues[q] (16 float32 values: nf4's)."""
    scale = tl.load(Scale + out * scale_row + group, mask=keep_outs, other=0.0).to(tl.float32)[:, None]
    zero = tl.zeros_like(scale)
    if ZERO:
        zero = tl.load(Zero + out * scale_row + group, mask=keep_outs, other=0.0).to(tl.float32)[:, None]
    if TABLE:
        return tl.load(CodeValues + q.to(tl.int32)) * scale + zero
    return q.to(tl.float32) * scale + (zero - 8.0 * scale)


@triton.jit
def _values(packed, Scale, Zero, CodeValues, out, scale_row, span, keep_outs, TABLE: tl.constexpr,
            PAIRED: tl.constexpr, ZERO: tl.constexpr):
    """The weights (float32) that the low and high halves of `packed` (outputs `out` × half a span) stand for: both
    of the span's group, or with PAIRED the low halves of its first group and the high halves of its second."""
    low, high = _span_groups(span, PAIRED)
    return (_half_values(packed & 15, Scale, Zero, CodeValues, out, scale_row, low, keep_outs, TABLE, ZERO),
            _half_values(packed >> 4, Scale, Zero, CodeValues, out, scale_row, high, keep_outs, TABLE, ZERO))


_WEIGHTS_PTX = """fma.rn.{fma} $0, t0, $5, $7;
fma.rn.{fma} $2, u0, $9, $11;
fma.rn.{fma} $1, t1, $6, $8;
fma.rn.{fma} $3, u1, $10, $12;
}}"""
# the PTX's operands: the low halves' weights of bytes 0-1 and 2-3 and the high halves' (outputs, two a register),
# the 4 bytes, then per pair of bytes the low halves' scale and zero and the high halves' (both halves of a register)
OPERANDS = tl.constexpr("=r,=r,=r,=r,r,r,r,r,r,r,r,r,r")


def _int4_decode_ptx(magic: int, one: int, minus: int, fma: str) -> str:
    """PTX turning 4 bytes of codes (weights j..j+3 in the low halves, SPAN / 2 + j.. in the high halves) and their
    scales and zeros (`OPERANDS`) into the weights, two a register: each code set into the mantissa of `magic` (a
    power of two whose unit in the last place is 1: magic + q, one LOP3 per two weights), `minus` (-(magic + 8))
    added exactly (a fused multiply-add by `one`), then (q - 8) · scale + zero in one fused multiply-add (rounded
    once)."""
    return f"""{{
.reg .b32 t0, t1, u0, u1, nothing, nibbles, magic, one, minus;
mov.b32 nothing, 0;
mov.b32 nibbles, 0x000F000F;
mov.b32 magic, {magic:#x};
mov.b32 one, {one:#x};
mov.b32 minus, {minus:#x};
prmt.b32 t0, $4, nothing, 0x4140;
prmt.b32 t1, $4, nothing, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 t0, t0, nibbles, magic, 0xEA;
lop3.b32 t1, t1, nibbles, magic, 0xEA;
lop3.b32 u0, u0, nibbles, magic, 0xEA;
lop3.b32 u1, u1, nibbles, magic, 0xEA;
fma.rn.{fma} t0, t0, one, minus;
fma.rn.{fma} t1, t1, one, minus;
fma.rn.{fma} u0, u0, one, minus;
fma.rn.{fma} u1, u1, one, minus;
""" + _WEIGHTS_PTX.format(fma=fma)


# per dtype, two a register: the magic (bfloat16 0x4300 = 128: 128 + q; float16 0x6400 = 1024: 1024 + q), one,
# minus (magic + 8) and the fused multiply-add's type (a table's PTX uses it too)
INT4_PATTERNS = {torch.bfloat16: (0x43004300, 0x3F803F80, 0xC308C308, "bf16x2"),
                  torch.float16: (0x64006400, 0x3C003C00, 0xE408E408, "f16x2")}
INT4_DECODE_PTX = {dtype: _int4_decode_ptx(*pattern) for dtype, pattern in INT4_PATTERNS.items()}


def _table_ptx(low: list[int], high: list[int], fma: str) -> str:
    """PTX turning 4 bytes of codes (as `_int4_decode_ptx`'s) into the weights by a table of 16 half-precision values
    (`low` and `high`: their bytes): each code's three low bits pick a byte of the table's first or second half
    (PRMT, four codes at a time, the raw halves of two bytes as its selector), the code's top bit picks the half
    (LOP3), the two bytes of each value are paired (PRMT), then value · scale + zero in one fused multiply-add."""
    words = [f"mov.b32 {name}{i}, {sum(b << 8 * j for j, b in enumerate(bytes_[4 * i:4 * i + 4])):#x};"
             for name, bytes_ in (("lo", low), ("hi", high)) for i in range(4)]
    lines = [".reg .b32 lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, pick, idx, top, a, b, pl, ph, t0, t1, u0, u1;",
             *words, "mov.b32 pick, 0x0000FF00;", "and.b32 idx, $4, 0x77777777;", "shr.b32 top, $4, 3;",
             "and.b32 top, top, 0x11111111;"]
    for half, (t, u) in enumerate((("t0", "u0"), ("t1", "u1"))):
        if half:
            lines += ["shr.b32 idx, idx, 16;", "shr.b32 top, top, 16;"]
        lines += ["prmt.b32 a, pick, pick, top;",  # 0xFF for each of the four codes above 7
                  "prmt.b32 pl, lo0, lo1, idx;", "prmt.b32 b, lo2, lo3, idx;", "lop3.b32 pl, pl, b, a, 0xD8;",
                  "prmt.b32 ph, hi0, hi1, idx;", "prmt.b32 b, hi2, hi3, idx;", "lop3.b32 ph, ph, b, a, 0xD8;",
                  f"prmt.b32 {t}, pl, ph, 0x6240;", f"prmt.b32 {u}, pl, ph, 0x7351;"]
    return "{\n" + "\n".join(lines) + "\n" + _WEIGHTS_PTX.format(fma=fma)


@functools.lru_cache(maxsize=None)
def table_ptx(dtype: torch.dtype, code_values: tuple[float, ...]) -> str:
    """`_table_ptx` for 16 code values, each rounded to `dtype` (half precision)."""
    bits = [b & 0xFFFF for b in torch.tensor(code_values, dtype=torch.float32).to(dtype).view(torch.int16).tolist()]
    return _table_ptx([b & 0xFF for b in bits], [b >> 8 for b in bits], INT4_PATTERNS[dtype][3])


def decode_ptx(dtype: torch.dtype, weight) -> str:
    """The PTX that the kernels make a `FourBitWeight`'s values in `dtype` with: on CUDA, where `dtype`, the scales
    and the zeros are one half-precision dtype, int4's bit patterns (`_int4_decode_ptx`) or a table (`table_ptx`, nf4);
    else "" (arithmetic in float32)."""
    halves = {weight.scale.dtype} | ({weight.zero.dtype} if weight.zero is not None else set())
    if not weight.packed.is_cuda or dtype not in INT4_PATTERNS or halves != {dtype}:
        return ""
    return INT4_DECODE_PTX[dtype] if weight.affine else table_ptx(dtype, tuple(weight.code_values))


@triton.jit
def _doubled(Values, out, scale_row, group, keep_outs, shape):
    """The scale or zero (`Values`: half precision) of `group` for each output, twice in a 32-bit word (as the PTX
    takes a pair of weights' scale), broadcast to `shape`."""
    bits = tl.load(Values + out * scale_row + group, mask=keep_outs, other=0.0).to(tl.uint16, bitcast=True)
    bits = bits.to(tl.uint32)
    return tl.broadcast_to((bits | (bits << 16))[:, None], shape)


@triton.jit
def _halves(words, dtype: tl.constexpr):
    """Half-precision values two a 32-bit word (`words`: outputs × n) as outputs × 2n values of `dtype`, in order."""
    first = (words & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True)
    second = (words >> 16).to(tl.uint16).to(dtype, bitcast=True)
    return tl.reshape(tl.join(first, second), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _pattern_values(pairs, Scale, Zero, out, scale_row, span, keep_outs, DECODE: tl.constexpr,
                    PAIRED: tl.constexpr, ZERO: tl.constexpr):
    """`_values` in half precision (Scale's and Zero's dtype) by `DECODE`' PTX from the bytes two at a time
    (`pairs`: uint16, outputs × a quarter span), each pair's four weights made as two pairs of values: no conversion
    per weight, and no byte taken apart and put together again on its way to the PTX (as a tensor of bytes was, which
    took longer). Without ZERO the zeros are 0, none read (nf4: faster again; both timed in docs/kernels.md)."""
    low, high = _span_groups(span, PAIRED)
    scale = _doubled(Scale, out, scale_row, low, keep_outs, pairs.shape)
    zero = tl.zeros(pairs.shape, dtype=tl.uint32)
    if ZERO:
        zero = _doubled(Zero, out, scale_row, low, keep_outs, pairs.shape)
    high_scale, high_zero = scale, zero
    if PAIRED:
        high_scale = _doubled(Scale, out, scale_row, high, keep_outs, pairs.shape)
        if ZERO:
            high_zero = _doubled(Zero, out, scale_row, high, keep_outs, pairs.shape)
    low_words, high_words = tl.inline_asm_elementwise(DECODE, OPERANDS, [pairs, scale, zero, high_scale, high_zero],
                                                      dtype=(tl.uint32, tl.uint32), is_pure=True, pack=2)
    dtype: tl.constexpr = Scale.dtype.element_ty
    return _halves(low_words, dtype), _halves(high_words, dtype)


@triton.jit
def four_bit_rows_kernel(X, W, Scale, Zero, CodeValues, Out, rows, outs, ins, x_row, w_row, scale_row, out_row,
                         out_split, GROUP: tl.constexpr, PAIRED: tl.constexpr, ZERO: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, SPLIT: tl.constexpr, PATTERN: tl.constexpr,
                         DECODE: tl.constexpr, TABLE: tl.constexpr):
    """Out[s, rows, outs] = X[rows, ins] · Wᵀ over every SPLIT-th span of the inner dimension from span s on (program
    (o, s, r), r the block of rows), in float32, W[o, i] = value(q) · Scale[o, g] + Zero[o, g], g = i // GROUP
    (`_values`: int4, or nf4's table with TABLE; Zero read only with ZERO), a span a group or with PAIRED two. The
    weights are the products' first operand (W · Xᵀ), made in the registers the tensor cores read them from (as the
    second operand they went through shared memory, which took longer: docs/kernels.md): with PATTERN by `DECODE`' PTX
    (`decode_ptx`: X's, Scale's and Zero's dtype), else in float32 and converted (Triton's interpreter)."""
    SPAN: tl.constexpr = GROUP * 2 if PAIRED else GROUP
    HALF: tl.constexpr = SPAN // 2
    PAIRS: tl.constexpr = HALF // 2
    block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    out = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    half = tl.arange(0, HALF)
    pair = tl.arange(0, PAIRS)
    keep_rows = row[None, :] < rows
    keep_outs = out < outs
    byte_pairs = W.to(tl.pointer_type(tl.uint16))  # the PTX's bytes, two at a time
    acc = tl.zeros((BLOCK_OUT, BLOCK_ROWS), dtype=tl.float32)
    for span in range(split, ins // SPAN, SPLIT):
        inputs = X + row[None, :] * x_row + span * SPAN + half[:, None]
        x_low = tl.load(inputs, mask=keep_rows, other=0.0)
        x_high = tl.load(inputs + HALF, mask=keep_rows, other=0.0)
        if PATTERN:
            pairs = tl.load(byte_pairs + out[:, None] * (w_row // 2) + span * PAIRS + pair[None, :],
                            mask=keep_outs[:, None], other=0)
            low, high = _pattern_values(pairs, Scale, Zero, out, scale_row, span, keep_outs, DECODE, PAIRED, ZERO)
        else:
            packed = tl.load(W + out[:, None] * w_row + span * HALF + half[None, :], mask=keep_outs[:, None], other=0)
            low, high = _values(packed, Scale, Zero, CodeValues, out, scale_row, span, keep_outs, TABLE, PAIRED, ZERO)
        acc += tl.dot(low.to(x_low.dtype), x_low)
        acc += tl.dot(high.to(x_low.dtype), x_high)
    tl.store(Out + split * out_split + row[None, :] * out_row + out[:, None], acc.to(Out.dtype.element_ty),
             mask=keep_rows & keep_outs[:, None])


@triton.jit
def four_bit_dequantize_kernel(W, Scale, Zero, CodeValues, Out, outs, w_row, scale_row, out_row, GROUP: tl.constexpr,
                           PAIRED: tl.constexpr, ZERO: tl.constexpr, BLOCK_OUT: tl.constexpr, TABLE: tl.constexpr):
    """Out[o, i] = W[o, i] (as in `four_bit_rows_kernel`, computed in float32) in Out's dtype, for the block of
    output columns program_id(0) and the span program_id(1). Bound by writing them: the rows kernel's bit patterns
    made it no faster (docs/kernels.md)."""
    SPAN: tl.constexpr = GROUP * 2 if PAIRED else GROUP
    HALF: tl.constexpr = SPAN // 2
    out = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    span = tl.program_id(1)
    half = tl.arange(0, HALF)
    keep = out[:, None] < outs
    packed = tl.load(W + out[:, None] * w_row + span * HALF + half[None, :], mask=keep, other=0)
    low, high = _values(packed, Scale, Zero, CodeValues, out, scale_row, span, out < outs, TABLE, PAIRED, ZERO)
    values = Out + out[:, None] * out_row + span * SPAN + half[None, :]
    tl.store(values, low.to(Out.dtype.element_ty), mask=keep)
    tl.store(values + HALF, high.to(Out.dtype.element_ty), mask=keep)
