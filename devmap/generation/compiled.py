"""torch.compile for one stage's step: inductor's fused kernels inside devmap's own captured CUDA graphs.

A stage step (a decode step, or a prompt's prefill) is compiled without inductor's CUDA graphs
(`mode=None`): devmap captures the compiled step itself, with its lanes' static KV caches, its per-stage
graph pools and its event ordering. The first call of a step compiles it (eager run), the second captures
it; a capture never compiles (a guard that fails there raises, and the step stays uncaptured). Compiled
code is shared by every lane of the same shapes on a stage, and across calls: torch keys it by the step's
code and guards, and its on-disk caches (inductor's FX graph and autotuning caches, on by default) make a
fresh process compile faster the second time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

BACKEND = "inductor"  # tests on CPU swap in "aot_eager": the same tracing and guards, no C++ compiler needed
RECOMPILE_LIMIT = 64  # a stage step has one entry per (stage, lane shape, kind); torch's default of 8 is too few


def compile_step(body: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`body` compiled for fixed shapes (no dynamic dimensions: every lane keeps its shape for the whole call)."""
    _raise_recompile_limit()
    return torch.compile(body, backend=BACKEND, dynamic=False, fullgraph=False)


@contextlib.contextmanager
def no_recompiles() -> Iterator[None]:
    """While capturing a CUDA graph: a compiled step whose guards fail raises instead of compiling (compiling
    launches and synchronizes work, which a capture cannot hold)."""
    set_stance: Any = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("fail_on_recompile"):
        yield


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; older releases use the second
        if hasattr(config, name):
            if getattr(config, name) < RECOMPILE_LIMIT:
                setattr(config, name, RECOMPILE_LIMIT)
            return
