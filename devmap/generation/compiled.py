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

from typing import Callable

import torch

from ..compat import raise_recompile_limit

BACKEND = "inductor"  # tests on CPU swap in "aot_eager": the same tracing and guards, no C++ compiler needed
RECOMPILE_LIMIT = 64  # a stage step has one entry per (stage, lane shape, kind); torch's default of 8 is too few


def compile_step(body: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`body` compiled for fixed shapes (no dynamic dimensions: every lane keeps its shape for the whole call)."""
    raise_recompile_limit(RECOMPILE_LIMIT)
    return torch.compile(body, backend=BACKEND, dynamic=False, fullgraph=False)

