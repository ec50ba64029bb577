"""`devmap save`: write a checkpoint of a preset (config.json + safetensors) that `from_pretrained` can read."""

from __future__ import annotations

from typing import Any

import click

from .output import echo_json


@click.command()
@click.argument("source")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--dtype", default=None, help="float32, float16 or bfloat16 (default: the preset's own dtype).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file; bigger checkpoints are sharded with an index (e.g. 500MB, 2GiB).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--weights", default=None, type=click.Path(dir_okay=False),
              help="A .safetensors file whose tensors to write instead of random ones.")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "nf4", "fp8"], case_sensitive=False),
              help="Write pre-quantized weights (int8, int4, fp8: torchao; nf4: bitsandbytes) in the layout "
                   "transformers' from_pretrained reads back; quantized on the devices of --device-map (4-bit needs "
                   "GPUs, fp8 GPUs of compute capability 8.9 and up).")
@click.option("--device-map", default="auto", show_default=True,
              help="Where the weights are quantized with --quantize (a strategy or one device, as for load).")
@click.option("--config-only", is_flag=True,
              help="Write the configs and tokenizer, no weights: a directory devmap serve --load-format dummy serves "
                   "with random weights made on its devices.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a summary.")
def save(source: str, out_dir: str, dtype: str | None, max_shard_size: str, seed: int, weights: str | None,
         quantize: str | None, device_map: str, config_only: bool, overwrite: bool, as_json: bool) -> None:
    """Write a checkpoint of SOURCE into OUT_DIR.

    SOURCE is a preset (resnet18..resnet152, llama-tiny, tinyllama-1.1b, llama-2-7b/13b/70b,
    llama-3-8b/70b). Weights are random (same --seed, same bytes) or come from --weights. Tensors are
    made one at a time, so memory stays near one shard; OUT_DIR appears only when everything is written.
    """
    import sys

    from tqdm import tqdm

    from devmap.planning.memory import format_bytes
    from devmap.loading.saver import save as save_checkpoint

    bars: list[Any] = []

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"Saving {source}",
                             disable=as_json or not sys.stderr.isatty(), leave=False))
        bars[0].update(done - bars[0].n)

    try:
        result = save_checkpoint(source, out_dir, dtype=dtype, max_shard_size=max_shard_size, seed=seed,
                                 weights=weights, overwrite=overwrite, progress=progress, quantization=quantize,
                                 device_map=device_map, config_only=config_only)
    finally:
        for bar in bars:
            bar.close()
    if as_json:
        echo_json(result.to_dict())
        return
    files = result.files
    shown = files if len(files) <= 6 else files[:4] + [f"... ({len(files) - 5} more)", files[-1]]
    click.echo(f"Saved {result.source} to {result.out_dir}")
    click.echo(f"  {result.num_tensors} tensors · {format_bytes(result.total_bytes)} · {result.dtype}"
               + (f" with {result.quantization} weights" if result.quantization else "")
               + (f" · {sum(f.endswith('.safetensors') for f in files)} shards" if result.sharded else ""))
    click.echo(f"  files: {', '.join(shown)}")
