"""docs/cli-reference.md is every command's own help: it fails while a command, an option or a help text differs."""

import importlib.util
from pathlib import Path

import click

from devmap.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _reference_module():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_what_the_commands_say():
    """Word for word (line wrapping aside, which click's releases change)."""
    text = (DOCS / "cli-reference.md").read_text()
    assert text.split() == _reference_module().reference_text().split(), "run: python docs/cli_reference.py"


def test_every_option_of_every_command_is_in_the_reference():
    text = (DOCS / "cli-reference.md").read_text()
    context = click.Context(main)
    for name in main.list_commands(context):
        assert f"## devmap {name}" in text
        for param in main.get_command(context, name).params:
            for flag in param.opts if isinstance(param, click.Option) else ():
                assert flag in text, f"devmap {name} {flag}"
