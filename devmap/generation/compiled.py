"""torch.compile for one stage's step: inductor's fused kernels inside devmap's own captured CUDA graphs.

A stage step (a decode step, or a prompt's prefill) is compiled without inductor's CUDA graphs
(`mode=None`): devmap captures the compiled step itself, with its lanes' static KV caches, its per-stage
graph pools and its event ordering. The first call of a step compiles it (eager run), the second captures
it; a capture never compiles (a guard that fails there raises, and the step stays uncaptured). Compiled
code is shared by every lane of the same shapes on a stage, and across calls: torch keys it by the step's
code and guards, and its on-disk caches (inductor's FX graph and autotuning caches, on by default) make a
fresh process compile faster the second time.

`dynamic=True` compiles one step for every batch size and cache length: the dimensions its caller marked
(`devmap.compat.dynamic_dims`: rows and cache columns) are symbolic, every other one fixed. A continuous batch meets
a new shape whenever a service's traffic grows; a fixed-shape compile cost 25–45 s per shape for a 1.1B model on an
H200, against about a second for a new capture of the dynamic step, with the same time per step once warm
(benchmarks/probes/compile_shapes.py). Making every size symbolic instead compiled for minutes.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..compat import distinct_sizes, raise_recompile_limit

BACKEND = "inductor"  # tests on CPU swap in "aot_eager": the same tracing and guards, no C++ compiler needed
RECOMPILE_LIMIT = 64  # a stage step has one entry per (stage, lane shape, kind); torch's default of 8 is too few


def compile_step(body: Callable[[torch.Tensor], torch.Tensor], dynamic: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """`body` compiled for fixed shapes (every lane of a `generate` call keeps its shape for the whole call), or with
    `dynamic` sizes (one compile for every shape a service's continuous batches take)."""
    raise_recompile_limit(RECOMPILE_LIMIT)
    step = torch.compile(body, backend=BACKEND, dynamic=None if dynamic else False, fullgraph=False)
    if not dynamic:
        return step

    def sized_apart(x: torch.Tensor) -> torch.Tensor:  # only eager calls and captures come here, never replays
        with distinct_sizes():
            return step(x)

    return sized_apart

