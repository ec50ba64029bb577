"""`devmap plan`: where each block of a model would go, as a table or JSON."""

from __future__ import annotations

import click

from .options import placement_options
from .output import echo_json, table


@click.command()
@click.argument("source")
@placement_options
@click.option("--offload-folder", default=None, help="Folder for disk offload (adds a disk budget).")
@click.option("--layers", is_flag=True, help="Also print a per-layer table (type, output shape, params, device).")
@click.option("--input-shape", default=None,
              help="With --layers: the whole input's shape, e.g. 1,3,224,224 or 1,128 (tokens). With --for: one "
                   "sample's shape, e.g. 3,224,224 (vision models; default 3,224,224).")
@click.option("--for", "workload_kind", default=None,
              type=click.Choice(["inference", "generate", "train", "serve"], case_sensitive=False),
              help="Plan the memory running needs too: KV cache (generate, serve), activations, gradients and "
                   "optimizer state (train), on the devices of the blocks that hold them.")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="With --for: rows per batch (default 1). With --for serve: the most rows a batch may have, as "
                   "devmap serve's --max-batch (default 64) per lane; the plan gets as many as fit.")
@click.option("--seq-len", default=None, type=click.IntRange(min=1),
              help="With --for on a LLaMA-style model: tokens per row (prompt + new tokens). With --for serve: "
                   "cache tokens per row (default: what devmap serve's default limits need on this model).")
@click.option("--chunks", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --for: micro-batches (pipelines) or lanes (generation) the batch is split into.")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["sgd", "momentum", "adam", "adamw"], case_sensitive=False),
              help="With --for train: the optimizer whose state is counted.")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "nf4", "fp8"], case_sensitive=False),
              help="Count the blocks' Linear weights quantized (int8, int4, fp8: torchao; nf4: bitsandbytes); "
                   "embeddings, norms and lm_head stay at --dtype.")
@click.option("--tensor-parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split every attention and MLP block of a LLaMA-family model over each group of N GPUs (their "
                   "KV heads too); the groups, in GPU order, are the pipeline's stages.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def plan(source: str, device_map: str, gpus: int | None, gpu_memory: str | None, max_memory: str | None,
         dtype: str | None, offload_folder: str | None, layers: bool, input_shape: str | None, quantize: str | None,
         workload_kind: str | None, batch: int | None, seq_len: int | None, chunks: int, optimizer: str,
         tensor_parallel: int, as_json: bool) -> None:
    """Plan where each block of SOURCE goes.

    SOURCE is a preset (resnet18..resnet152, llama-tiny, tinyllama-1.1b, llama-2-7b/13b/70b,
    llama-3-8b/70b) or a local directory with a config.json. Planning runs on the meta device:
    no memory is allocated and no weights are read.
    """
    from devmap.planning.layers import layer_table, parse_shape
    from devmap.planning.planner import plan as make_plan, planner

    if input_shape is not None and not layers and workload_kind is None:
        raise click.UsageError("--input-shape applies with --layers or --for")
    given = parse_shape(input_shape) if input_shape else None
    workload = None

    def plan_with(workload):  # type: ignore[no-untyped-def]
        return make_plan(source, device_map, max_memory, dtype, gpus=gpus, gpu_memory=gpu_memory,
                         offload_folder=offload_folder, quantization=quantize, workload=workload,
                         tensor_parallel=tensor_parallel)

    serving = None
    if workload_kind is not None and workload_kind.lower() == "serve":
        serving = _serving_plan(source, batch, seq_len, chunks, input_shape, planner(
            source, device_map, max_memory, dtype, gpus=gpus, gpu_memory=gpu_memory, offload_folder=offload_folder,
            quantization=quantize, tensor_parallel=tensor_parallel))
        result = serving.plan
    elif workload_kind is not None:
        from devmap.planning.models import resolve_source
        from devmap.planning.workload import parse_workload

        model_source = resolve_source(source)
        context = int(getattr(model_source.config, "max_position_embeddings", 0) or 0)
        workload = parse_workload(workload_kind, causal_lm=model_source.is_causal_lm, context=context,
                                  batch=batch or 1, seq_len=seq_len, input_shape=given, chunks=chunks,
                                  optimizer=optimizer)
    elif seq_len is not None or batch is not None or chunks != 1:
        raise click.UsageError("--batch, --seq-len and --chunks describe a workload: give --for too")
    if serving is None:
        result = plan_with(workload)
    shape = ((batch or 1), *given) if given is not None and workload is not None else given
    rows = layer_table(result, shape) if layers else None
    if as_json:
        data = result.to_dict()
        if rows is not None:
            data["layers"] = [r.to_dict() for r in rows]
        if serving is not None:
            data["serving"] = {"max_batch": serving.rows, "lanes": serving.lanes,
                               "cache_tokens_per_row": serving.cache_len}
        echo_json(data)
        return
    click.echo(render_plan(result))
    if serving is not None:
        lanes = f" in {serving.lanes} lanes" if serving.lanes > 1 else ""
        click.echo(f"Serves batches of up to {serving.rows} rows{lanes} of {serving.cache_len} cache tokens each "
                   "(devmap serve plans each load so).")
    if rows is not None:
        from devmap.planning.memory import format_bytes

        click.echo("\nLayers:")
        click.echo(table(
            ["layer", "type", "output shape", "params", "size", "device"],
            [[r.name, r.type, "x".join(map(str, r.output_shape)) if r.output_shape else "-", f"{r.params:,}",
              format_bytes(r.bytes), r.device] for r in rows],
            right=(3, 4),
        ))


def render_plan(result) -> str:  # type: ignore[no-untyped-def]
    """The per-device table and the condensed map of a Plan."""
    from dataclasses import replace

    from devmap.planning.devices import parse_device_key
    from devmap.planning.memory import dtype_name, format_bytes, format_count

    kind = "simulated GPUs" if result.budget.simulated else "real devices"
    quantized = (f" with {result.quantization.scheme} weights ({result.quantization.library})"
                 if result.quantization else "")
    head = (f"{result.source} · {result.strategy} · {dtype_name(result.dtype)}{quantized} · "
            f"{format_count(result.total_params)} params · {format_bytes(result.total_bytes)} · budgets for {kind}")
    rows = [
        [name, len(u.modules), format_count(u.params), format_bytes(u.bytes),
         format_bytes(u.budget) if u.budget is not None else "-",
         f"{100 * u.share:.1f}%" if u.share is not None else "-"]
        for name, u in result.devices.items()
    ]
    lines = [head]
    if result.quantization and result.unquantized_bytes:
        lines.append(f"Quantized to {result.quantization.scheme}: {format_bytes(result.total_bytes)} instead of "
                     f"{format_bytes(result.unquantized_bytes)} in {dtype_name(result.dtype)} "
                     f"({', '.join(result.quantization.skip_modules)}, embeddings and norms stay in "
                     f"{dtype_name(result.dtype)})")
        if result.total_bytes > result.unquantized_bytes:
            from devmap.planning.quantization import larger_than_unquantized

            lines.append(larger_than_unquantized(result.quantization))
    if result.tensor_parallel is not None:
        lines.append(result.tensor_parallel.describe())
    if result.workload is not None:
        w = result.workload
        shape = f"{w.batch} × {w.seq_len} tokens" if w.seq_len else f"{w.batch} × {'x'.join(map(str, w.input_shape))}"
        unit = "lane" if w.seq_len and w.kind != "train" else "chunk"
        lines.append(f"For {w.kind}: {shape}, {w.chunks} {unit}{'' if w.chunks == 1 else 's'}"
                     + (f", {w.optimizer}" if w.kind == "train" else "")
                     + "; runtime bytes measured on the meta device")
        rows = [[name, len(u.modules), format_bytes(u.bytes), format_bytes(u.kv_cache_bytes),
                 format_bytes(u.activation_bytes), format_bytes(u.other_bytes), format_bytes(u.total),
                 format_bytes(u.budget) if u.budget is not None else "-",
                 f"{100 * u.share:.1f}%" if u.share is not None else "-"] for name, u in result.devices.items()]
        headers = ["device", "blocks", "weights", "kv cache", "activations", "other", "total", "budget", "use"]
    else:
        headers = ["device", "blocks", "params", "size", "budget", "use"]
    lines += ["", table(headers, rows, right=tuple(range(1, len(headers)))), "", "Map:"]
    split = result.tensor_parallel
    lines += [f"  {run}" if split is None else f"  {replace(run, device=split.label(parse_device_key(run.device)))}"
              for run in result.runs]
    lines += [f"Warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def _serving_plan(source, batch, seq_len, chunks, input_shape, plan_with):  # type: ignore[no-untyped-def]
    """What `devmap serve` plans for SOURCE with its default limits (`--batch`: its --max-batch; `--seq-len`: cache
    tokens per row instead of what the limits need)."""
    from devmap.planning.models import resolve_source
    from devmap.serving.errors import ServiceError
    from devmap.serving.limits import EngineLimits
    from devmap.serving.load_plan import plan_serving

    if input_shape is not None:
        raise click.UsageError("--for serve plans tokens: give --seq-len, not --input-shape")
    defaults = EngineLimits()
    limits = EngineLimits(max_batch=batch or defaults.max_batch, lanes=chunks if chunks > 1 else None)
    try:
        return plan_serving(resolve_source(source), limits, plan_with, cache_len=seq_len)
    except ServiceError as exc:
        raise click.UsageError(exc.message) from None
