"""`torchrun ... -m devmap train`: train a model split into pipeline stages over ranks
(torch.distributed.pipelining)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator

import click

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb")


@click.command()
@click.option("--model", default="resnet50", show_default=True, help="A torchvision model name (resnet18..resnet152).")
@click.option("--factory", default=None, help="module:function returning the nn.Module, instead of --model.")
@click.option("--num-classes", default=1000, show_default=True, type=click.IntRange(min=1))
@click.option("--checkpoint", default=None, type=click.Path(exists=True),
              help="safetensors checkpoint to start from; each rank reads only its own stage's tensors.")
@click.option("--split-points", default=None, help="Comma-separated blocks that start a stage, e.g. layer3.")
@click.option("--device-map", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A JSON file {module: stage} (a devmap plan's map: its devices are the stages, in order).")
@click.option("--stages", default=None, type=click.IntRange(min=1),
              help="Cut into this many FLOP-balanced stages (default: one per rank, two for interleaved and zb).")
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(SCHEDULE_NAMES, case_sensitive=False))
@click.option("--chunks", default=4, show_default=True, type=click.IntRange(min=1), help="Micro-batches per step.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--input-shape", default="3,224,224", show_default=True, help="One sample's shape.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=0))
@click.option("--lr", default=0.001, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--eval-batches", default=0, show_default=True, type=click.IntRange(min=0),
              help="After training, this many batches in eval mode; their mean loss is reported.")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Directory for losses.json, each rank's final stage tensors and the eval outputs.")
@click.option("--nproc-per-node", default=None, type=click.IntRange(min=1),
              help="Start this many ranks on this machine and wait for them (as torchrun --standalone does), "
                   "with devmap's exit codes (2: bad input). Not needed under torchrun.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line (from the last stage's rank).")
def train(as_json: bool, nproc_per_node: int | None, **options: Any) -> None:
    """Train a model cut into pipeline stages over several ranks (gloo on CPUs, NCCL on GPUs).

    Run as `devmap train --nproc-per-node N ...` on one machine, or under torchrun
    (`torchrun --nproc-per-node N -m devmap train ...`; several machines: --nnodes and a rendezvous endpoint).
    Rank 0 shows each step's progress on a terminal; the last stage's rank prints the losses.
    The data is the PyTorch tutorial's: random images, one-hot labels, MSE.
    """
    config = config_from(options)  # bad options are refused here, before any rank starts
    if "RANK" not in os.environ:
        if nproc_per_node is None:
            raise click.UsageError("give --nproc-per-node N (ranks on this machine), or run under torchrun: "
                                   "torchrun --nproc-per-node 2 -m devmap train ...")
        from .rank_launch import relaunch

        relaunch(nproc_per_node, "train", "--nproc-per-node")
        return
    import torch
    import torch.distributed as dist

    from devmap.distributed.training import train as run_training

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        with _step_progress(config.steps, quiet=as_json or dist.get_rank() != 0) as on_step:
            result = run_training(config, on_step)
    finally:
        dist.destroy_process_group()
    if result is None:
        return
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(render_result(result, config.schedule))


@contextlib.contextmanager
def _step_progress(steps: int, quiet: bool) -> Iterator[Callable[[int, float], None]]:
    """A progress bar of the steps on a terminal (rank 0; none with --json or off a terminal)."""
    import sys

    from tqdm import tqdm

    with tqdm(total=steps, desc="train", unit="step", file=sys.stderr, leave=False,
              disable=quiet or not sys.stderr.isatty()) as bar:
        def on_step(step: int, seconds: float) -> None:
            bar.set_postfix_str(f"{seconds:.3f} s/step")
            bar.update(1)

        yield on_step


def render_result(result: dict[str, Any], schedule: str) -> str:
    """The run's summary line and a table of its steps (and its eval losses)."""
    from .output import table

    best = f"; best step {min(result['step_seconds']):.3f} s" if result["step_seconds"] else ""
    lines = [f"{result['ranks']} ranks, {result['stages']} stages, {schedule}{best}"]
    rows = [[step + 1, f"{loss:.6f}", f"{seconds:.3f}"]
            for step, (loss, seconds) in enumerate(zip(result["losses"], result["step_seconds"]))]
    if rows:
        lines += ["", table(["step", "loss", "seconds"], rows, right=(0, 1, 2))]
    if result.get("eval_losses"):
        lines += ["", "eval losses: " + ", ".join(f"{x:.6f}" for x in result["eval_losses"])]
    return "\n".join(lines)


def config_from(options: dict[str, Any]) -> Any:
    """The TrainConfig of the command's options (tests parse the same options into the same config)."""
    from devmap.distributed.training import TrainConfig

    chosen = [name for name in ("split_points", "device_map", "stages") if options.get(name) is not None]
    if len(chosen) > 1:
        raise click.UsageError(f"give one of --split-points, --device-map and --stages, not {len(chosen)}")
    try:
        shape = tuple(int(s) for s in options["input_shape"].split(","))
    except ValueError:
        raise click.UsageError(f"--input-shape {options['input_shape']!r}: give integers like 3,224,224") from None
    points = options.get("split_points")
    return TrainConfig(**{**options, "input_shape": shape,
                          "split_points": [p for p in points.split(",") if p] if points else None})


def parse(argv: list[str]) -> Any:
    """TrainConfig from command-line arguments, without running anything."""
    with train.make_context("train", list(argv)) as ctx:
        options = dict(ctx.params)
    options.pop("as_json", None)
    options.pop("nproc_per_node", None)
    return config_from(options)
