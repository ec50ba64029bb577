"""fp8 products: float8 (e4m3) weights with a scale per output row, each token of the input quantized to float8 as it
comes (the weights torchao's float8 Linear holds), on the library measured fastest at each size. devmap writes no
fp8 kernel: up to `GEMV_ROWS` rows (decode steps) gemlite's fp8 × fp8 GEMV and split-K products, reading the
weight's own tensors in place; past them torchao's float8 Linear (`torch._scaled_mm`), as its model runs. Where
gemlite is not installed, every size runs torchao's. The measurement behind the choice is in docs/kernels.md
(`benchmarks/products.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.nn import functional as F

from ..compat import gemlite_fp8_linear, torchao_fp8_weight

KERNEL_DTYPES = (torch.bfloat16,)  # torchao's float8 products with a scale per row take bfloat16 inputs
GEMV_ROWS = 64  # gemlite's products up to this many rows (exclusive); its GEMM and torchao's from here on


@dataclass(eq=False)
class Fp8Weight:
    """A float8 weight (`qdata`: out × in, float8_e4m3fn; `scale`: out × 1, float32), torchao's float8 weight of the
    same tensors (`library`, its Linear's product) and gemlite's Linear over them (`gemlite`: None without gemlite or
    off a GPU)."""

    qdata: torch.Tensor
    scale: torch.Tensor
    library: Any
    gemlite: Any = None

    @classmethod
    def of(cls, qdata: torch.Tensor, scale: torch.Tensor, like: Any) -> Fp8Weight:
        """The weight of these tensors, its torchao weight with `like`'s settings (a weight of the model's), gemlite's
        Linear made now (never inside a traced or captured step)."""
        library = torchao_fp8_weight(qdata, scale, like)
        linear = gemlite_fp8_linear(qdata, scale, library.dtype) if qdata.is_cuda else None
        return cls(qdata, scale, library, linear)

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def kernel_applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether gemlite computes x (… × in) · weightᵀ: an input in bfloat16 of fewer than `GEMV_ROWS` rows, the weight
    on a GPU with gemlite installed."""
    return weight.gemlite is not None and x.dtype in KERNEL_DTYPES and _rows(x) < GEMV_ROWS


def product(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (… × in) · weightᵀ (+ bias), in x's dtype: gemlite's product where it applies, torchao's elsewhere."""
    if kernel_applies(x, weight):
        out = weight.gemlite(x)
        return out if bias is None else out + bias
    return F.linear(x, weight.library, bias)


def prepare_kernels(weights: Iterable[Fp8Weight], dtype: torch.dtype) -> int:
    """Run gemlite's products once for each weight shape at every row count below `GEMV_ROWS` (it tunes at the first
    product of a bucket of row counts and Triton compiles by the rows' divisibility, neither of which a CUDA-graph
    capture may do); the products run (0 without gemlite)."""
    done: set[tuple[int, ...]] = set()
    runs = 0
    for weight in weights:
        if tuple(weight.shape) in done or dtype not in KERNEL_DTYPES or weight.gemlite is None:
            continue
        done.add(tuple(weight.shape))
        for rows in range(1, GEMV_ROWS):
            product(torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.qdata.device), weight)
            runs += 1
    return runs
