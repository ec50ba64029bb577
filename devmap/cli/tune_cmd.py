"""`devmap tune`: measure a ResNet pipeline at several micro-batch counts and report the best."""

from __future__ import annotations

import click

from .output import echo_json, table


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: every count must be a positive integer")
    return values


@click.command()
@click.argument("source")
@click.option("--devices", default=None, help="Devices of the stages, e.g. cuda:0,cuda:1 (default: every GPU).")
@click.option("--batch-size", default=120, show_default=True, type=click.IntRange(min=1))
@click.option("--image-size", default=128, show_default=True, type=click.IntRange(min=16))
@click.option("--chunks", "chunks_text", default="1,2,3,4,6,8", show_default=True, help="Micro-batch counts to try.")
@click.option("--balance", type=click.Choice(["measure", "time", "memory"], case_sensitive=False), default="measure",
              show_default=True,
              help="Stage boundaries: profiled then refined by measured steps, profiled only, or the device map's "
                   "memory balance.")
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1), help="Timed steps per candidate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def tune(source: str, devices: str | None, batch_size: int, image_size: int, chunks_text: str, balance: str,
         steps: int, as_json: bool) -> None:
    """Find the micro-batch count that trains SOURCE (a torchvision ResNet) fastest on the given devices."""
    import sys

    import torch
    import torchvision
    from tqdm import tqdm

    from devmap.errors import UsageError
    from devmap.loading.loader import dispatch
    from devmap.planning.models import RESNETS
    from devmap.pipelining import pipeline
    from devmap.pipelining.tuning import tune as run_tune

    candidates = _ints(chunks_text)
    if source not in RESNETS:
        raise UsageError(f"devmap tune measures torchvision ResNets ({', '.join(RESNETS)}); got {source!r}")
    if devices is None:
        count = torch.cuda.device_count()
        if count == 0:
            raise UsageError("no GPU is visible: pass --devices cpu for a CPU run")
        devices = ",".join(f"cuda:{i}" for i in range(count))
    devs = [torch.device(d.strip()) for d in devices.split(",") if d.strip()]
    for d in devs:
        if d.type == "cuda" and (d.index is None or d.index >= torch.cuda.device_count()):
            raise UsageError(f"device {d} is not visible ({torch.cuda.device_count()} GPUs)")
    model = getattr(torchvision.models, source)()
    gpus = sorted({d.index for d in devs if d.type == "cuda"})
    if gpus:
        total = {g: torch.cuda.get_device_properties(g).total_memory for g in gpus}
        dispatch(model, "balanced", max_memory=total)
    else:
        dispatch(model, {"": "cpu"}, max_memory={"cpu": "100%"})
    sample = torch.randn(batch_size, 3, image_size, image_size, device=devs[0])
    middle = sorted(candidates)[len(candidates) // 2]
    pipeline(model, chunks=min(middle, batch_size), balance=None if balance == "memory" else balance, sample=sample)
    bar = tqdm(total=len(candidates), desc="tuning", leave=False, disable=as_json or not sys.stderr.isatty())
    try:
        result = run_tune(lambda c: pipeline(model, chunks=c), sample, candidates, steps=steps, progress=bar.update)
    finally:
        bar.close()
    data = result.to_dict() | {"source": source, "devices": [str(d) for d in devs], "image_size": image_size,
                               "stages": pipeline(model, chunks=1).block_names}
    if as_json:
        echo_json(data)
        return
    click.echo(f"{source}, batch {batch_size} at {image_size}x{image_size}, stages on {', '.join(map(str, devs))}")
    click.echo(table(["chunks", "micro-batch", "ms/step", "samples/s"],
                     [[r["chunks"], r["micro_batch"], f"{1000 * r['seconds']:.1f}", f"{r['samples_per_s']:.0f}"]
                      for r in result.table], right=(0, 1, 2, 3)))
    click.echo(f"Best: chunks={result.best_chunks} (split_size={-(-batch_size // result.best_chunks)}), "
               f"{1000 * result.best_seconds:.1f} ms per step")
