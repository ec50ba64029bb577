"""This rank's stages of a split model as `torch.distributed.pipelining` stages, and the schedule that runs them.

One stage per rank for "gpipe" and "1f1b"; two per rank for "interleaved" (rank r holds stages r and r+W,
looping) and "zb" (zero-bubble V: rank r holds stages r and 2W-1-r). Works with the process group torchrun
sets up: gloo on CPUs, NCCL on GPUs, ranks on one node or several.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..compat import pipeline_stage_fixed
from ..errors import PipelineError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def stage_indices(schedule: str, rank: int, world: int, stages: int) -> list[int]:
    """Which stages `rank` runs; refuses a stage count the schedule cannot use with `world` ranks."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    if stages != per_rank * world:
        raise PipelineError(f"schedule {schedule!r} runs {per_rank} stage(s) per rank: {world} ranks need "
                            f"{per_rank * world} stages, the split has {stages}")
    if schedule == "interleaved":
        return [rank, rank + world]
    if schedule == "zb":
        return [rank, 2 * world - 1 - rank]
    return [rank]


def _schedule_class(schedule: str) -> Any:
    from torch.distributed import pipelining

    return {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved": pipelining.ScheduleInterleaved1F1B, "zb": pipelining.ScheduleZBVZeroBubble}[schedule]


class RankPipeline:
    """The stages of one rank and their schedule. `train_step` and `forward` are called on every rank with the
    same arguments; only the rank holding the first stage reads `x`, only the one holding the last `target`."""

    def __init__(self, stage_modules: Sequence[nn.Module], schedule: str = "1f1b", chunks: int = 4,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | str | None = None, group: Any = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        if not dist.is_initialized():
            raise PipelineError("no process group: run under torchrun (or call torch.distributed.init_process_group)")
        if chunks < 1:
            raise PipelineError(f"chunks must be a positive number of micro-batches, got {chunks}")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else default_device()
        self.indices = stage_indices(schedule, self.rank, self.world, len(stage_modules))
        self.total = len(stage_modules)
        self.modules = [stage_modules[i].to(self.device) for i in self.indices]
        self.stages = [pipeline_stage_fixed(PipelineStage(m, i, self.total, self.device, group=group))
                       for m, i in zip(self.modules, self.indices)]
        self.schedule_name, self.chunks, self.loss_fn = schedule, chunks, loss_fn
        self._schedules: dict[bool, Any] = {}

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.total - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def _schedule(self, training: bool) -> Any:
        if training not in self._schedules:
            cls = _schedule_class(self.schedule_name)
            stages = self.stages[0] if len(self.stages) == 1 else self.stages
            self._schedules[training] = cls(stages, self.chunks, loss_fn=self.loss_fn if training else None)
        return self._schedules[training]

    def train_step(self, x: torch.Tensor | None = None, target: torch.Tensor | None = None) -> float | None:
        """Forward and backward of one batch in micro-batches (gradients accumulate in the stage parameters,
        averaged over micro-batches); returns the mean micro-batch loss on the rank with the last stage."""
        if self.loss_fn is None:
            raise PipelineError("train_step needs the loss_fn the RankPipeline was built with")
        for module in self.modules:
            module.train()
        args = (x.to(self.device),) if self.first else ()
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if self.last:
            kwargs = {"target": target.to(self.device), "losses": losses}
        self._schedule(True).step(*args, **kwargs)
        if not self.last:
            return None
        return float(torch.stack([loss.detach() for loss in losses]).mean())

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """The batch's output (on the rank with the last stage; None elsewhere), modules in eval mode."""
        if self.schedule_name == "zb":
            raise PipelineError("the zero-bubble V schedule only trains (its actions include backward); run "
                                "inference with a gpipe, 1f1b or interleaved RankPipeline")
        for module in self.modules:
            module.eval()
        args = (x.to(self.device),) if self.first else ()
        out = self._schedule(False).step(*args)  # a schedule of the same stages without a loss: forward only
        return out if self.last else None


def default_device() -> torch.device:
    """This rank's GPU (LOCAL_RANK) when CUDA is there, else the CPU."""
    import os

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
