"""The `devmap` command line: a click group whose one error boundary turns devmap errors into one-line messages.

`run` is the program (`devmap`, `python -m devmap`): the group, then the process's end without the interpreter's
teardown, which frees every object of torch's and transformers' modules one by one (most of a second after
transformers' models: docs/cli.md) and does nothing a finished command needs. The exit handlers still run
(logging's flush, temporary files, child processes) and stdout and stderr are flushed; a command that leaves a
thread running ends the usual way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Any

import click

# Commands live in their own modules and import torch only when they run, so `devmap --help` is instant.
_COMMANDS = {
    "plan": ("devmap.cli.plan_cmd", "plan"),
    "env": ("devmap.cli.env_cmd", "env"),
    "load": ("devmap.cli.load_cmd", "load"),
    "save": ("devmap.cli.save_cmd", "save"),
    "compare": ("devmap.cli.compare_cmd", "compare"),
    "tune": ("devmap.cli.tune_cmd", "tune"),
    "generate": ("devmap.cli.generate_cmd", "generate"),
    "serve": ("devmap.cli.serve_cmd", "serve"),
    "train": ("devmap.cli.train_cmd", "train"),
}


class DevmapGroup(click.Group):
    """Lazy subcommands, and errors shown as one line: exit 2 for usage errors, 1 for runtime failures."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        import importlib.util

        return sorted(n for n, (m, _) in _COMMANDS.items() if importlib.util.find_spec(m) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        import importlib

        module, attr = _COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        extra.pop("standalone_mode", None)
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv
        if not debug:  # torchao, imported by transformers where installed, warns through torch's logger on import
            import logging

            logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
        try:
            result = super().main(args=argv, prog_name=prog_name, standalone_mode=False, **extra)
            from .rank_launch import end_launched_rank, is_launched_rank

            if is_launched_rank():
                end_launched_rank()
            return result
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail(f"{exc.format_message()}{hint}", 2, debug)
        except click.Abort:
            _fail("aborted", 1, debug)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code, debug)
        except Exception as exc:  # the boundary: everything else becomes one line
            from devmap.errors import DevmapError

            if isinstance(exc, DevmapError):
                _fail(str(exc), exc.exit_code, debug)
            if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
                _fail(f"out of memory: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                      "lower the budgets with --max-memory or offload to cpu/disk", 1, debug)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _fail(f"unexpected {type(exc).__name__}: {first} (run with --debug for the traceback)", 1, debug)


def _fail(message: str, code: int, debug: bool) -> None:
    if debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    from .rank_launch import end_launched_rank, report_rank_error

    if report_rank_error(message, code):  # a rank of `devmap train --nproc-per-node`: its launcher prints it
        end_launched_rank(code)
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


@click.group(cls=DevmapGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
@click.version_option(package_name="devmap")
def main(debug: bool) -> None:
    """Spread one PyTorch model over the GPUs of a machine, and make them work together."""
    if click.get_current_context().invoked_subcommand != "env":  # env shows every release, then refuses the same way
        from devmap.releases import require_supported

        require_supported()


def run() -> None:
    """`devmap` as a program: the command, its exit code, and the process's end (`end_process`)."""
    try:
        main.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    end_process(code)


def end_process(code: int) -> None:
    """End this process with `code` after its exit handlers and flushed output, skipping the interpreter's teardown;
    where a thread other than a daemon is still running, the interpreter ends it as usual (it waits for the thread)."""
    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # CPython's own call at exit: the handlers registered with atexit, last first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write to
            pass
    os._exit(code)
