"""Printing helpers for the CLI: aligned tables and JSON."""

from __future__ import annotations

import json
from typing import Any, Sequence

import click


def echo_json(data: Any) -> None:
    """Print one JSON object."""
    click.echo(json.dumps(data, indent=2, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; column indices in `right` are right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])
