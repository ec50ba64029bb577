"""Past one process: a devmap split run on PyTorch's own `torch.distributed.pipelining` under torchrun.

Owns the split of a model into per-rank stage modules (the same units and residual-block cuts as devmap's
single-process pipeline, from a device map, split points or a stage count), the rank's `PipelineStage`s and
schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble V), loading only a rank's own tensors from a
safetensors checkpoint, and the training loop behind `devmap train` (its ranks started by `--nproc-per-node` or by
torchrun). Imports `devmap.pipelining`, `devmap.loading`, `devmap.planning` and `devmap.errors`; devmap never
implements its own distributed engine.
"""

from __future__ import annotations

from .rank_pipeline import SCHEDULES, RankPipeline, stage_indices
from .split import StageSplit, split_model
from .stage_weights import load_stage_weights
from .training import TrainConfig, train

__all__ = ["SCHEDULES", "RankPipeline", "StageSplit", "TrainConfig", "load_stage_weights", "split_model",
           "stage_indices", "train"]
