"""`devmap env`: the GPUs, host memory and library versions devmap sees."""

from __future__ import annotations

import click

from .output import echo_json, table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def env(as_json: bool) -> None:
    """Show GPUs (memory, peer access), host memory and library versions."""
    from devmap.planning.hardware import describe_environment
    from devmap.planning.memory import format_bytes

    info = describe_environment()
    if as_json:
        echo_json(info.to_dict())
        return
    if info.gpus:
        click.echo(table(
            ["gpu", "name", "capability", "total", "free"],
            [[f"cuda:{g.index}", g.name, g.capability, format_bytes(g.total_bytes), format_bytes(g.free_bytes)]
             for g in info.gpus],
            right=(3, 4),
        ))
        if info.peer_access:
            click.echo("\nPeer access: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info.peer_access.items()))
    else:
        click.echo("GPUs: none visible (CUDA " + ("not available" if info.cuda is None else f"{info.cuda} build, no device") + ")")
    click.echo(f"\nCPU: {info.cpu_count} cores, {format_bytes(info.cpu_available_bytes)} available "
               f"of {format_bytes(info.cpu_total_bytes)}")
    click.echo(f"Python {info.python}; " + ", ".join(f"{k} {v or 'not installed'}" for k, v in info.versions.items()))
    for note in info.notes:
        click.echo(f"Note: {note}")
