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
@click.option("--input-shape", default=None, help="Input shape for --layers, e.g. 1,3,224,224 or 1,128 (tokens).")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "nf4"], case_sensitive=False),
              help="Count the blocks' Linear weights quantized (int8: torchao, int4: torchao, nf4: bitsandbytes); "
                   "embeddings, norms and lm_head stay at --dtype.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def plan(source: str, device_map: str, gpus: int | None, gpu_memory: str | None, max_memory: str | None,
         dtype: str | None, offload_folder: str | None, layers: bool, input_shape: str | None, quantize: str | None,
         as_json: bool) -> None:
    """Plan where each block of SOURCE goes.

    SOURCE is a preset (resnet18..resnet152, llama-tiny, tinyllama-1.1b, llama-2-7b/13b/70b,
    llama-3-8b/70b) or a local directory with a config.json. Planning runs on the meta device:
    no memory is allocated and no weights are read.
    """
    from devmap.planning.layers import layer_table, parse_shape
    from devmap.planning.planner import plan as make_plan

    if input_shape is not None and not layers:
        raise click.UsageError("--input-shape only applies with --layers")
    shape = parse_shape(input_shape) if input_shape else None
    result = make_plan(source, device_map, max_memory, dtype, gpus=gpus, gpu_memory=gpu_memory,
                       offload_folder=offload_folder, quantization=quantize)
    rows = layer_table(result, shape) if layers else None
    if as_json:
        data = result.to_dict()
        if rows is not None:
            data["layers"] = [r.to_dict() for r in rows]
        echo_json(data)
        return
    click.echo(render_plan(result))
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
    lines += ["", table(["device", "blocks", "params", "size", "budget", "use"], rows, right=(1, 2, 3, 4, 5)),
             "", "Map:"]
    lines += [f"  {run}" for run in result.runs]
    lines += [f"Warning: {w}" for w in result.warnings]
    return "\n".join(lines)
