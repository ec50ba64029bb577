"""A Triton kernel for the GPU tests (imported only where they run): every pair of a row's max and a value up to it,
quantized by `quantize_rows_kernel`'s arithmetic and by a correctly rounded division, mismatches counted per max."""

import triton
import triton.language as tl

from devmap.kernels.int8_products_kernel import ROUNDING, _rounded_int8, _token_scale


@triton.jit
def rounding_mismatches_kernel(Values, Mismatches, count, BLOCK: tl.constexpr, RECIPROCAL_FROM: tl.constexpr):
    """Mismatches[i] += the values v ≤ Values[i] (Values: positive, ascending) whose int8 by the kernels' arithmetic
    differs from round-half-to-even of the correctly rounded v / scale, the scale of a row whose max is Values[i]
    (both signs of v: the kernels' arithmetic is odd in v), scales from RECIPROCAL_FROM on by their reciprocal."""
    most = tl.load(Values + tl.program_id(0))
    place = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(Values + place, mask=place < count, other=0.0)
    keep = (place < count) & (value <= most)
    scale, inverse = _token_scale(most)
    wrong = tl.zeros((BLOCK,), dtype=tl.int32)
    for sign in tl.static_range(2):
        x = value * (1.0 - 2.0 * sign)
        exact = ((tl.math.div_rn(x, scale) + ROUNDING) - ROUNDING).to(tl.int8)
        wrong += (keep & (_rounded_int8(x, scale, inverse, RECIPROCAL_FROM) != exact)).to(tl.int32)
    tl.atomic_add(Mismatches + tl.program_id(0), tl.sum(wrong, axis=0))
