"""Triton's Gluon (`triton.experimental.gluon`: layouts, shared memory, TMA, mbarriers and Hopper's warpgroup MMA
spelled out), in the names each Triton release gives them, for `kernels.four_bit_products_wgmma`. Gluon is
experimental and renames between releases: checked on Triton 3.6 (torch 2.11) and 3.8 (torch 2.14).

| name here | Triton 3.6 | Triton 3.8 |
|---|---|---|
| `tma_load` | `hopper.tma.async_copy_global_to_shared` | `hopper.tma.async_load` |
| `cta_barrier` | `gl.thread_barrier` | `gl.barrier` |

Imported only where the kernel runs or is compiled (Triton comes with torch's CUDA wheels); `sm90_compile` builds
the kernel for sm_90 without a GPU (tests compile it at both ends of the supported releases)."""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon  # noqa: F401 - re-exported for the kernel module
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 - re-exported
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - re-exported

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def sm90_compile(kernel: Any, signature: dict[str, str], constants: dict[str, Any], aligned: tuple[str, ...],
                 num_warps: int) -> Any:
    """`kernel` compiled for sm_90 here, with or without a GPU: `signature` in Triton's type strings (descriptors
    as `descriptor_type`'s), `constants` the constexpr arguments, `aligned` the arguments taken as multiples of 16
    (as the launcher specializes them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def descriptor_type(dtype: str, block: list[int], layout: Any) -> str:
    """The signature string of a TensorDescriptor of `dtype` ('bf16', 'u8', ...) with `block` and `layout`."""
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"
