"""Linear layers with 4-bit weights in devmap's plain layout (`four_bit_layout.FourBitWeight`), and taking a loaded
model's torchao int4 Linear layers (tinygemm's layout) and bitsandbytes' nf4 ones into it: they become `FourBitLinear`
modules with the same codes, code values and scales, read by devmap's kernels. The serving engine does this at load
(`join_projections`), before joining a layer's projections; anything that calls a layer (transformers' own forward too)
gets the same products."""

from __future__ import annotations

import torch
from torch import nn

from ..compat import bitsandbytes_four_bit_codes, device_hook_moved, torchao_int4_codes
from .four_bit_layout import INT4_CODE_VALUES, FourBitWeight, packed_halves, span_of
from . import four_bit_products


class FourBitLinear(nn.Module):
    """y = x · weightᵀ + bias with `weight` a FourBitWeight (its tensors are the module's buffers)."""

    def __init__(self, weight: FourBitWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero)
        self.code_values = tuple(weight.code_values)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def four_bit(self) -> FourBitWeight:
        return FourBitWeight(self.packed, self.scale, self.zero, self.code_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return four_bit_products.product(x, self.four_bit, self.bias)

    def extra_repr(self) -> str:
        kind = "int4" if self.code_values == INT4_CODE_VALUES else "4-bit table"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, group={self.four_bit.group}"


def four_bit_weight(linear: nn.Module) -> FourBitWeight | None:
    """The layer's weight in devmap's layout: torchao's int4 or bitsandbytes' nf4 (on a GPU) taken apart, else None.
    nf4's absmax becomes the scale, in the weight's dtype (rounded from float32), with no zero."""
    weight = getattr(linear, "weight", None)
    if not isinstance(linear, nn.Linear) or not isinstance(weight, torch.Tensor):
        return None
    parts = torchao_int4_codes(weight)
    if parts is not None:
        q, scale, zero = parts
        return FourBitWeight(packed_halves(q, span_of(q.shape[1], q.shape[1] // scale.shape[1])), scale, zero)
    table = bitsandbytes_four_bit_codes(weight)
    if table is None:
        return None
    q, absmax, code_values, dtype = table
    scale = absmax.to(dtype)
    span = span_of(q.shape[1], q.shape[1] // scale.shape[1])
    return FourBitWeight(packed_halves(q, span), scale, None, tuple(code_values))


@torch.no_grad()
def own_four_bit_linears(model: nn.Module) -> int:
    """Swap each torchao int4 or bitsandbytes nf4 Linear of the model's decoder layers for a FourBitLinear of the
    same numbers and accelerate hook, one at a time (the old weight freed before the next); one whose hook brings
    offloaded weights in, or whose device has no room to take it apart for a moment, stays. Returns the layers
    swapped."""
    swapped = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for name, module in list(layer.named_modules()):
            try:
                weight = four_bit_weight(module)
            except torch.OutOfMemoryError:  # no room for the moment it takes: the layer keeps its library's products
                continue
            if weight is None:
                continue
            new = FourBitLinear(weight, getattr(module, "bias", None))
            if not device_hook_moved(module, new):
                continue
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, attr, new)
            swapped += 1
    return swapped
