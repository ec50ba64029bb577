"""devmap's 4-bit layout (`FourBitWeight`), which its 4-bit products (`four_bit_products`) read: per output row, two
weights a byte, in each span of weights weight j in the low half of byte j and weight span/2 + j in its high half; a
span is a group (of 128 weights or more) or two smaller groups (`span_of`), the first group in the low halves and the
second in the high halves, so that a kernel's loop step takes at least SPAN weights of a row. A weight is its 4-bit
code q (0..15) standing for a code value: w = value(q) · scale + zero per group, int4's values q - 8 (torchao,
tinygemm's formula) or a table of 16 (bitsandbytes' nf4). Here: the type, packing and unpacking, the full-precision
weight, int4 quantizing for tests and CPU use, and the code values as a table."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

SPAN = 128  # weights of an output row the kernels take a step at the least where two groups make them (nf4's groups
# of 64 in pairs: one group a step took longer, docs/kernels.md)


INT4_CODE_VALUES = tuple(float(q - 8) for q in range(16))  # int4's code values (torchao, tinygemm's formula)


class FourBitWeight(NamedTuple):
    """A weight of `outs` × `ins` in 4 bits: `packed` (outs × ins/2 uint8, per span of s weights s/2 bytes: weight j
    in the low half of byte j, s/2 + j in the high half), `scale` and `zero` (outs × ins/group, the weight's dtype;
    zero None: none, w = code_values[q] · scale) and the 16 `code_values` the 4-bit codes q stand for:
    w = code_values[q] · scale + zero.
    int4 (torchao): q - 8; nf4 (bitsandbytes): its table of 16 values, scale each block's absmax, no zero."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    code_values: tuple[float, ...] = INT4_CODE_VALUES

    @property
    def group(self) -> int:
        return 2 * self.packed.shape[1] // self.scale.shape[1]

    @property
    def span(self) -> int:
        """Weights of an output row whose bytes hold them (`span_of`)."""
        return span_of(self.shape[1], self.group)

    @property
    def paired(self) -> bool:
        """Whether a span is two groups: the first group's weights in its bytes' low halves, the second's in the high
        halves."""
        return self.span != self.group

    @property
    def affine(self) -> bool:
        """Whether the code values are int4's (q - 8), which the kernels make without a table."""
        return tuple(self.code_values) == INT4_CODE_VALUES

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.packed, self.scale, self.zero

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]


def zero_or_scale(weight: FourBitWeight) -> torch.Tensor:
    """What the kernels' `Zero` argument gets: the zeros, or for a weight with none (their ZERO off), any tensor of
    the scales' dtype (the scales: never read)."""
    return weight.scale if weight.zero is None else weight.zero


def span_of(ins: int, group: int) -> int:
    """The weights of an output row whose bytes hold them (their first half in the low halves, the second in the high
    halves) for an inner dimension of `ins` in groups of `group`: two groups where they make at most SPAN weights and
    `ins` holds whole pairs, else one."""
    return 2 * group if 2 * group <= SPAN and ins % (2 * group) == 0 else group


def packed_halves(q: torch.Tensor, span: int) -> torch.Tensor:
    """CodeValues `q` (outs × ins, 0..15) two a byte: in each span, the first half in the low halves of its bytes."""
    spans = q.to(torch.uint8).reshape(q.shape[0], -1, 2, span // 2)
    return (spans[:, :, 0] | (spans[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def codes(packed: torch.Tensor, span: int) -> torch.Tensor:
    """The 4-bit codes (outs × ins, uint8 0..15) that `packed` holds (its spans of `span` weights)."""
    grouped = packed.reshape(packed.shape[0], -1, 1, span // 2)
    return torch.cat([grouped & 15, grouped >> 4], dim=2).reshape(packed.shape[0], -1)


def quantize_int4(weight: torch.Tensor, group: int = 128) -> FourBitWeight:
    """`weight` (outs × ins) as int4 with tinygemm's formula: per group its range in 15 steps, zero its middle (q =
    8), scale and zero in the weight's dtype. For tests and CPU use; served int4 weights come from torchao's."""
    outs, ins = weight.shape
    if ins % group or group % 2:
        raise ValueError(f"int4 weights need an inner dimension that is a multiple of the group ({group}), got {ins}")
    grouped = weight.float().reshape(outs, ins // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(outs, ins)
    return FourBitWeight(packed_halves(q, span_of(ins, group)), scale.to(weight.dtype).contiguous(),
                         (low + 8 * scale).to(weight.dtype).contiguous())


def dequantize(weight: FourBitWeight, dtype: torch.dtype) -> torch.Tensor:
    """The full-precision weight (outs × ins) the 4 bits stand for, in `dtype` (computed in float32)."""
    outs, ins = weight.shape
    q = codes(weight.packed, weight.span)
    table = None if weight.affine else code_value_table(weight.code_values, q.device, weight.scale.dtype)
    value = q.float() - 8 if table is None else table[q.long()]
    grouped = value.reshape(outs, -1, weight.group) * weight.scale.float()[..., None]
    if weight.zero is not None:
        grouped = grouped + weight.zero.float()[..., None]
    return grouped.reshape(outs, ins).to(dtype)


_TABLES: dict[tuple[tuple[float, ...], torch.device, torch.dtype], torch.Tensor] = {}


def code_value_table(code_values: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 16 code values as a float32 tensor on `device`, each rounded to `dtype` (the scales': a weight stands for
    value · scale + zero with both factors in the weight's dtype, as the rows kernel makes it, whatever path computes
    it; int4's code values are exact), made once per device and dtype (never inside a CUDA graph's capture after
    `prepare_kernels`)."""
    key = (tuple(code_values), torch.device(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(key[0], dtype=torch.float32).to(dtype).to(device=device, dtype=torch.float32)
    return _TABLES[key]
