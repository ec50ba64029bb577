"""fp8 products: float8 (e4m3) weights with a scale per output row, each token of the input quantized to float8 as it
comes (the weights torchao's float8 Linear holds), joined like int8 weights and multiplied by torchao's float8 Linear
(`torch._scaled_mm`, fused with the tokens' quantization where the step is compiled). devmap writes no fp8 kernel.
gemlite's fp8 products are faster per product at decode rows, but tune for a minute per weight shape in every new
process (docs/kernels.md has both measurements), which a service that must answer in seconds cannot pay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.nn import functional as F

from ..compat import torchao_fp8_weight

KERNEL_DTYPES = (torch.bfloat16,)  # torchao's float8 products with a scale per row take bfloat16 inputs


@dataclass(eq=False)
class Fp8Weight:
    """A float8 weight (`qdata`: out × in, float8_e4m3fn; `scale`: out × 1, float32) and torchao's float8 weight of
    the same tensors (`library`, its Linear's product)."""

    qdata: torch.Tensor
    scale: torch.Tensor
    library: Any

    @classmethod
    def of(cls, qdata: torch.Tensor, scale: torch.Tensor, like: Any) -> Fp8Weight:
        """The weight of these tensors, its torchao weight with `like`'s settings (a weight of the model's)."""
        return cls(qdata, scale, torchao_fp8_weight(qdata, scale, like))

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape


def kernel_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether a kernel of devmap's computes x · weightᵀ: never (torchao's product does)."""
    return False


def product(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype, by torchao's float8 Linear."""
    return F.linear(x, weight.library, bias)


def prepare_kernels(weights: Iterable[Fp8Weight], dtype: torch.dtype) -> int:
    """Nothing to prepare: torchao's product compiles with the step that runs it."""
    return 0
