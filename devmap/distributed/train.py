"""`torchrun --nproc-per-node N -m devmap.distributed.train ...`: train a model split into pipeline stages over ranks.

Every rank builds the same model (seeded, or on meta with `--checkpoint` so that each reads only its own
stage's tensors), cuts it the way devmap's single-process pipeline would (`--split-points`, `--device-map` or
`--stages`), and runs its stages with torch.distributed.pipelining's schedule. The data is the PyTorch
tutorial's: random images and one-hot labels under MSE, seeded per step, so every run is reproducible.
The rank holding the last stage prints the per-step losses (`--json`: one JSON line); `--out DIR` also
writes them (losses.json) and each rank's final stage tensors (rank{R}.safetensors, model names).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DevmapError, UsageError
from .rank_pipeline import SCHEDULES, RankPipeline, default_device, stage_indices
from .split import split_model
from .stage_weights import load_stage_weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m devmap.distributed.train", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision model name (resnet18..resnet152, ...)")
    parser.add_argument("--factory", default=None, help="module:function returning the nn.Module, instead of --model")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--checkpoint", default=None, help="safetensors checkpoint (directory or file) to start from")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--split-points", default=None, help="comma-separated blocks that start a stage, e.g. layer3")
    where.add_argument("--device-map", default=None, help="a JSON file {module: stage} (e.g. devmap plan --json)")
    where.add_argument("--stages", type=int, default=None, help="devmap's balanced split into this many stages")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-shape", default="3,224,224", help="one sample's shape, e.g. 3,224,224")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="after training, this many batches in eval mode: their mean loss is reported")
    parser.add_argument("--out", default=None, help="directory for losses.json, each rank's final tensors and "
                        "the eval outputs")
    parser.add_argument("--json", action="store_true", help="print one JSON line (from the last stage's rank)")
    return parser


def make_model(args: argparse.Namespace, meta: bool) -> nn.Module:
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


def batch(args: argparse.Namespace, step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    x = torch.randn(args.batch_size, *shape, generator=generator)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)
    return x, torch.zeros(args.batch_size, args.num_classes).scatter_(1, labels.view(-1, 1), 1)


def stages_wanted(args: argparse.Namespace, world: int) -> int:
    return args.stages or world * (1 if args.schedule in ("gpipe", "1f1b") else 2)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.eval_batches and args.schedule == "zb":
        raise UsageError("--eval-batches runs forward-only schedules; the zero-bubble V schedule only trains: "
                         "pick gpipe, 1f1b or interleaved to evaluate")
    device = default_device()
    model = make_model(args, meta=args.checkpoint is not None)
    if args.device_map:
        split = split_model(model, device_map=json.loads(Path(args.device_map).read_text()))
    elif args.split_points:
        split = split_model(model, split_points=[p for p in args.split_points.split(",") if p])
    else:
        split = split_model(model, stages=stages_wanted(args, world),
                            sample_shape=[int(s) for s in args.input_shape.split(",")])
    if args.checkpoint is not None:  # this rank's stages only, straight onto its device; the rest stays on meta
        mine = [split.modules[i] for i in stage_indices(args.schedule, rank, world, len(split))]
        load_stage_weights(model, mine, args.checkpoint, device)
    pipe = RankPipeline(split.modules, args.schedule, args.chunks, nn.MSELoss(), device)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    shape = tuple(int(s) for s in args.input_shape.split(","))
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("Error: run under torchrun, e.g. torchrun --nproc-per-node 2 -m devmap.distributed.train ...",
              file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = run(args)
    except DevmapError as exc:  # one line; torchrun then stops the other ranks
        print(f"Error (rank {dist.get_rank()}): {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result is not None:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['ranks']} ranks, {result['stages']} stages, {args.schedule}: losses "
                  + ", ".join(f"{x:.6f}" for x in result["losses"])
                  + (f"; step {min(result['step_seconds']):.3f} s (best)" if result["step_seconds"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
