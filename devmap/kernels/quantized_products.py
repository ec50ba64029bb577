"""devmap's quantized products behind one protocol: each family (`int8_products` for int8 weights with a scale per
output row, `four_bit_products` for devmap's 4-bit layout, `fp8_products` for float8 weights with a scale per output
row, on torchao's product) says when its kernels apply to an input, computes the product (its kernels where they
apply, the library's formula elsewhere) and prepares its kernels for a model's weights at load. Callers hold a
weight of any kind (`QuantizedWeight`) and call `product` and `prepare_kernels` here, never a family by name."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Protocol, Union

import torch

from . import four_bit_products, fp8_products, int8_products
from .four_bit_layout import FourBitWeight
from .fp8_products import Fp8Weight
from .int8_products import Int8Weight

QuantizedWeight = Union[Int8Weight, FourBitWeight, Fp8Weight]


class ProductFamily(Protocol):
    """What a family of quantized products offers (its module implements it)."""

    KERNEL_DTYPES: tuple[torch.dtype, ...]

    def kernel_applies(self, x: torch.Tensor, weight: Any) -> bool:
        """Whether its kernels compute x (rows × in) · weightᵀ."""

    def product(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (… × in) · weightᵀ (+ bias), in x's dtype."""

    def prepare_kernels(self, weights: Iterable[Any], dtype: torch.dtype) -> int:
        """Compile every kernel variant a step may use for these weights now; the products run (0: none apply)."""


def family(weight: QuantizedWeight) -> ProductFamily:
    """The family that multiplies by `weight`."""
    if isinstance(weight, FourBitWeight):
        return four_bit_products  # type: ignore[return-value]
    return fp8_products if isinstance(weight, Fp8Weight) else int8_products  # type: ignore[return-value]


def product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype, by the weight's family."""
    return family(weight).product(x, weight, bias)


def prepare_kernels(weights: Iterable[QuantizedWeight], dtype: torch.dtype) -> int:
    """`prepare_kernels` of each weight's family for its weights; the products run."""
    by_family: dict[Any, list[QuantizedWeight]] = defaultdict(list)
    for weight in weights:
        by_family[family(weight)].append(weight)
    return sum(kernels.prepare_kernels(group, dtype) for kernels, group in by_family.items())
