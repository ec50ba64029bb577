"""`devmap.pipeline`: a Pipeline from explicit stages or a placed model, its boundaries balanced by time or
measurement."""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

from ..errors import PipelineError
from ..planning.workload import Workload
from .pipe import Pipeline, check_placed, from_placement
from .stages import StageSpec, apply_units, block_devices, check_stage_devices, placed_units, whole_block_devices


def pipeline(
    model: Union[nn.Module, Sequence[StageSpec]],
    chunks: int | None = None,
    split_size: int | None = None,
    *,
    balance: str | None = None,
    sample: torch.Tensor | None = None,
    graphs: str = "auto",
    deferred_weights: int | None = 1,
    workload: Workload | None = None,
) -> Pipeline:
    """Wrap a placed model (devmap.load / dispatch) or explicit [(module, device), ...] stages as a Pipeline.

    Stages come from the device map: consecutive blocks on one device form a stage. `balance="time"`
    moves stage boundaries so stages take about equal time by profiling each block (needs `sample`, one
    input batch); `balance="measure"` then moves each boundary a block either way while a measured
    training step gets faster (slower to set up, best split).

    With CUDA graphs, every stage after the first splits the backward of its first `deferred_weights`
    micro-batches in backward order (None: all; 0: none) into the input gradient, handed back at once, and
    the weight gradients of its Linear and convolution layers, computed at the end of the pass where they fill
    the pipeline's drain; each such micro-batch keeps the gradients at those layers' outputs until then.

    `workload` (`devmap.planning.workload.parse_workload`, the description `devmap.load` and `devmap plan --for`
    take) is checked before anything runs: a run whose activations, gradients and optimizer state will not fit
    beside the weights on some GPU is refused with the numbers (DoesNotFitError).
    """
    if isinstance(model, (list, tuple)):
        return Pipeline(check_stage_devices(model), chunks, split_size, graphs, deferred_weights)
    check_placed(model)
    if workload is not None:
        from ..planning.runtime_check import check_runtime_room

        check_runtime_room(model, workload, "devmap.pipeline")
    if balance not in (None, "memory", "time", "measure"):
        raise PipelineError(f"invalid balance={balance!r}: use 'memory' (the device map's), 'time' or 'measure'")
    if balance in ("time", "measure"):
        from .balance import balance_by_time
        from .refine import refine_cut, refine_split

        if sample is None:
            raise PipelineError(f"balance={balance!r} needs sample=<one input batch> to profile the blocks")
        first = block_devices(model, placed_units(model))[0]
        micro = Pipeline([(nn.Identity(), first)], chunks, split_size).micro_batches(sample)[0]
        blocks, block_devs = whole_block_devices(model)
        apply_units(model, blocks, block_devs)  # a block cut by an earlier balance is whole again
        # "time" may cut a residual block at a boundary; "measure" cuts only after refining whole blocks
        units, devices = balance_by_time(blocks, block_devs, micro, cut_blocks=balance == "time")
        apply_units(model, units, devices)  # the placement is now per unit; hf_device_map tells the truth
        if balance == "measure":  # per-block profiles miss what blocks cost together: measure whole steps
            count = chunks or (1 if split_size is None else -(-sample.shape[0] // split_size))
            refine_split(model, sample, count)
            refine_cut(model, sample, count)
    return from_placement(model, chunks, split_size, graphs, deferred_weights)
