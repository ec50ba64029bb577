"""Linear layers with int4 weights in devmap's plain layout (`four_bit_products.FourBitWeight`), and taking a loaded
model's torchao int4 Linear layers (tinygemm's layout) into it: they become `FourBitLinear` modules with the same
numbers, read by devmap's kernels. The serving engine does this at load (`join_projections`), before joining a layer's
projections; anything that calls a layer (transformers' own forward too) gets the same products."""

from __future__ import annotations

import torch
from torch import nn

from ..compat import device_hook_moved, torchao_int4_levels
from .four_bit_products import FourBitWeight, four_bit_product, packed_halves


class FourBitLinear(nn.Module):
    """y = x · weightᵀ + bias with `weight` a FourBitWeight (its tensors are the module's buffers)."""

    def __init__(self, weight: FourBitWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def four_bit(self) -> FourBitWeight:
        return FourBitWeight(self.packed, self.scale, self.zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return four_bit_product(x, self.four_bit, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group={self.four_bit.group}"


def four_bit_weight(linear: nn.Module) -> FourBitWeight | None:
    """The layer's weight in devmap's layout: torchao's int4 (on a GPU) taken apart, else None."""
    weight = getattr(linear, "weight", None)
    if not isinstance(linear, nn.Linear) or not isinstance(weight, torch.Tensor):
        return None
    parts = torchao_int4_levels(weight)
    if parts is None:
        return None
    q, scale, zero = parts
    return FourBitWeight(packed_halves(q, q.shape[1] // scale.shape[1]), scale, zero)


@torch.no_grad()
def own_four_bit_linears(model: nn.Module) -> int:
    """Swap each torchao int4 Linear of the model's decoder layers for a FourBitLinear of the same numbers and
    accelerate hook, one at a time (the old weight freed before the next); one whose hook brings offloaded weights in,
    or whose device has no room to take it apart for a moment, stays. Returns the layers swapped."""
    swapped = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for name, module in list(layer.named_modules()):
            try:
                weight = four_bit_weight(module)
            except torch.OutOfMemoryError:  # no room for the moment it takes: the layer keeps torchao's products
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
