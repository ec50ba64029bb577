"""Training a model split over ranks (the library side of `torchrun ... -m devmap train`): build the model on every
rank (seeded, or on meta with a checkpoint so that each reads only its own stage's tensors), cut it as devmap's
single-process pipeline would, and run its stages with torch.distributed.pipelining's schedule on the PyTorch
tutorial's data (random images, one-hot labels, MSE), seeded per step so that every run is reproducible.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .rank_pipeline import RankPipeline, default_device, stage_indices
from .split import split_model
from .stage_weights import load_stage_weights


@dataclass
class TrainConfig:
    """One distributed training run; the CLI's options, one for one."""

    model: str = "resnet50"
    factory: str | None = None  # "module:function" returning the nn.Module, instead of a torchvision model
    num_classes: int = 1000
    checkpoint: str | None = None
    split_points: list[str] | None = None
    device_map: str | None = None  # a JSON file {module: stage}
    stages: int | None = None
    schedule: str = "1f1b"
    chunks: int = 4
    batch_size: int = 32
    input_shape: tuple[int, ...] = (3, 224, 224)
    steps: int = 3
    lr: float = 0.001
    seed: int = 0
    eval_batches: int = 0
    out: str | None = None


def make_model(args: TrainConfig, meta: bool) -> nn.Module:
    torch.manual_seed(args.seed)  # the same weights on every rank
    with torch.device("meta") if meta else torch.device("cpu"):
        if args.factory:
            module_name, _, attr = args.factory.partition(":")
            try:
                return getattr(importlib.import_module(module_name), attr)()
            except (ImportError, AttributeError) as exc:
                raise UsageError(f"--factory {args.factory}: {exc}") from None
        import torchvision

        try:
            return torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes)
        except ValueError as exc:
            raise UsageError(f"--model {args.model}: {exc}") from None


def batch(args: TrainConfig, step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    x = torch.randn(args.batch_size, *shape, generator=generator)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)
    return x, torch.zeros(args.batch_size, args.num_classes).scatter_(1, labels.view(-1, 1), 1)


def stages_wanted(args: TrainConfig, world: int) -> int:
    return args.stages or world * (1 if args.schedule in ("gpipe", "1f1b") else 2)


def train(args: TrainConfig, on_step: Callable[[int, float], None] | None = None) -> dict[str, Any] | None:
    """Run the steps on this rank (inside an initialized process group); the result on the last stage's rank.
    `on_step(step, seconds)` is called on every rank after each step (all ranks are through it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.eval_batches and args.schedule == "zb":
        raise UsageError("--eval-batches runs forward-only schedules; the zero-bubble V schedule only trains: "
                         "pick gpipe, 1f1b or interleaved to evaluate")
    device = default_device()
    model = make_model(args, meta=args.checkpoint is not None)
    if args.device_map:
        split = split_model(model, device_map=json.loads(Path(args.device_map).read_text()))
    elif args.split_points:
        split = split_model(model, split_points=args.split_points)
    else:
        split = split_model(model, stages=stages_wanted(args, world), sample_shape=args.input_shape)
    if args.checkpoint is not None:  # this rank's stages only, straight onto its device; the rest stays on meta
        mine = [split.modules[i] for i in stage_indices(args.schedule, rank, world, len(split))]
        load_stage_weights(model, mine, args.checkpoint, device)
    pipe = RankPipeline(split.modules, args.schedule, args.chunks, nn.MSELoss(), device)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    shape = tuple(args.input_shape)
    losses, seconds = [], []
    for step in range(args.steps):
        x, target = batch(args, step, shape)
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        loss = pipe.train_step(x, target)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if on_step is not None:
            on_step(step + 1, seconds[-1])
    eval_losses, outputs = [], {}
    for k in range(args.eval_batches):
        x, target = batch(args, args.steps + k, shape)
        out = pipe.forward(x)
        if out is not None:
            eval_losses.append(float(nn.functional.mse_loss(out.float().cpu(), target)))
            outputs[f"batch{k}"] = out.detach().cpu().contiguous()
    if args.out:
        save_rank(model, pipe, Path(args.out), rank)
    if not pipe.last:
        return None
    result = {"ranks": world, "schedule": args.schedule, "stages": len(split), "stage_blocks": split.names,
              "losses": losses, "step_seconds": seconds, "eval_losses": eval_losses}
    if args.out and outputs:
        from safetensors.torch import save_file

        save_file(outputs, str(Path(args.out) / "eval_outputs.safetensors"))
    if args.out:
        (Path(args.out) / "losses.json").write_text(json.dumps(result))
    return result


def save_rank(model: nn.Module, pipe: RankPipeline, out: Path, rank: int) -> None:
    from safetensors.torch import save_file

    owned = {id(t) for t in [*pipe.parameters(), *(b for m in pipe.modules for b in m.buffers())]}
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict(keep_vars=True).items()
               if id(t) in owned}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / f"rank{rank}.safetensors"))
