"""`python -m devmap` runs the CLI."""

from devmap.cli import run

run()
