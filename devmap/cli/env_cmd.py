"""`devmap env`: the GPUs, host memory and library releases devmap sees, each release against its tested range."""

from __future__ import annotations

import click

from .output import echo_json, table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def env(as_json: bool) -> None:
    """Show GPUs (memory, peer access), host memory and library releases (exit 2 if one is outside its tested
    range)."""
    from devmap.planning.hardware import describe_environment
    from devmap.planning.memory import format_bytes
    from devmap.releases import require_supported

    info = describe_environment()
    if as_json:
        echo_json(info.to_dict())
        require_supported()
        return
    if info.gpus:
        click.echo(table(
            ["gpu", "name", "capability", "total", "free"],
            [[f"cuda:{g.index}", g.name, g.capability, format_bytes(g.total_bytes), format_bytes(g.free_bytes)]
             for g in info.gpus],
            right=(3, 4),
        ))
        if info.peer_access:
            pairs = (f"{k} {'yes' if v else 'no'}" for k, v in info.peer_access.items())
            click.echo("\nPeer access: " + ", ".join(pairs))
    else:
        cuda = "not available" if info.cuda is None else f"{info.cuda} build, no device"
        click.echo(f"GPUs: none visible (CUDA {cuda})")
    click.echo(f"\nCPU: {info.cpu_count} cores, {format_bytes(info.cpu_available_bytes)} available "
               f"of {format_bytes(info.cpu_total_bytes)}")
    click.echo(f"Python {info.python}\n")
    click.echo(table(
        ["package", "installed", "tested", "status"],
        [[r["package"], r["version"] or "-", r["tested"], _status(r)] for r in info.releases],
    ))
    for note in info.notes:
        click.echo(f"Note: {note}")
    require_supported()


def _status(release: dict) -> str:
    if not release["supported"]:
        return "OUTSIDE"
    return "ok" if release["version"] else "optional"
