"""`devmap load`: a checkpoint onto its planned devices, with per-device bytes, time and GB/s."""

from __future__ import annotations

import time

import click

from .options import load_options
from .output import echo_json, table


@click.command()
@click.argument("source")
@load_options
@click.option("--offload-folder", default=None, help="Folder for blocks offloaded to disk.")
@click.option("--weights", default=None, help="A .safetensors file (e.g. a ResNet's weights).")
@click.option("--allow-missing", is_flag=True, help="Initialize tensors the checkpoint lacks instead of failing.")
@click.option("--allow-pickle", is_flag=True, help="Read .bin/.pt checkpoints with torch.load(weights_only=True).")
@click.option("--run", "run_forward", is_flag=True, help="Run one forward pass on a sample input.")
@click.option("--prompt", default=None, help="With --run on a LLaMA directory with a tokenizer: text to feed.")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1), help="Batch for --run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object; no progress bar.")
def load(source: str, device_map: str, max_memory: str | None, dtype: str | None, quantize: str | None,
         offload_folder: str | None,
         weights: str | None, allow_missing: bool, allow_pickle: bool, run_forward: bool, prompt: str | None,
         batch_size: int, as_json: bool) -> None:
    """Load SOURCE (a local model directory or a preset) onto its devices.

    Presets without --weights are randomly initialized on their devices, and the output says so.
    """
    from tqdm import tqdm

    from devmap.loading.loader import load as load_model

    if prompt is not None and not run_forward:
        raise click.UsageError("--prompt only applies with --run")
    import sys

    # A progress bar on a terminal only: not with --json, not into pipes or logs.
    bar = tqdm(total=None, unit="B", unit_scale=True, desc="loading", leave=False,
               disable=as_json or not sys.stderr.isatty())
    try:
        model = load_model(source, device_map, max_memory, dtype, offload_folder, weights,
                           allow_missing=allow_missing, allow_pickle=allow_pickle, progress=bar.update,
                           quantization=quantize)
    finally:
        bar.close()
    report = model.devmap_load_report
    data = {"load": report.to_dict(), "plan": model.devmap_plan.to_dict()}
    if run_forward:
        data["run"] = _run(model, prompt, batch_size)
    if as_json:
        echo_json(data)
        return
    from devmap.cli.plan_cmd import render_plan
    from devmap.planning.memory import format_bytes

    click.echo(render_plan(model.devmap_plan))
    origin = f"random init (no checkpoint: {report.source} has no weights given)" if report.random_init \
        else f"from {report.checkpoint}"
    moved = max((d.seconds for d in report.devices.values()), default=0.0)
    click.echo(f"\nLoaded {origin} in {report.seconds:.2f} s: {moved:.2f} s reading and copying weights (the "
               "slowest device below), the rest making the model (random weights too, without a checkpoint), planning "
               "and placing hooks")
    click.echo(table(
        ["device", "blocks", "planned", "allocated", "time", "GB/s"],
        [[d.device, d.blocks, format_bytes(d.planned_bytes),
          format_bytes(d.allocated_bytes) if d.allocated_bytes is not None else "-",
          f"{d.seconds:.2f} s", f"{d.gb_per_s:.1f}" if d.gb_per_s else "-"] for d in report.devices.values()],
        right=(1, 2, 3, 4, 5),
    ))
    if report.mapped_bytes:
        click.echo(f"{format_bytes(report.mapped_bytes)} of host weights are views of the checkpoint's files (as "
                   "transformers' CPU loads): read from the page cache on first use, never copied")
    if report.initialized:
        click.echo(f"Initialized randomly (missing from the checkpoint): {', '.join(report.initialized[:5])}")
    if run_forward:
        run = data["run"]
        click.echo(f"\nForward pass: input {run['input_shape']} -> output {run['output_shape']} "
                   f"in {run['seconds']:.3f} s")


def _run(model, prompt: str | None, batch_size: int) -> dict:  # type: ignore[no-untyped-def]
    """One forward pass on a sample input on the first device; times it with a synchronize."""
    import torch

    plan = model.devmap_plan
    source = plan.model_source
    from devmap.planning.devices import is_gpu, torch_device

    gpus = [d for d in plan.device_map.values() if is_gpu(d)]
    device = torch_device(gpus[0] if gpus else "cpu")
    if prompt is not None:
        if source.kind != "hf-dir":
            raise click.UsageError("--prompt needs a model directory with a tokenizer")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"{source.path} has no usable tokenizer ({str(exc).splitlines()[0]})") from None
        inputs = tokenizer([prompt] * batch_size, return_tensors="pt")["input_ids"].to(device)
    else:
        shape = (batch_size, 128) if source.is_causal_lm else (batch_size, 3, 224, 224)
        inputs = source.sample_input(shape, device=device)
    with torch.no_grad():
        start = time.perf_counter()
        output = model(inputs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    logits = output.logits if hasattr(output, "logits") else output
    return {"input_shape": list(inputs.shape), "output_shape": list(logits.shape), "seconds": seconds}
