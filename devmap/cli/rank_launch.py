"""`devmap train --nproc-per-node N`: start the ranks on this machine as `torchrun --standalone` does (PyTorch's
own elastic launcher, in this process) and give back devmap's exit code: 2 when the ranks refused bad input, 1
for a failure, with one line saying what was wrong instead of torchrun's report of every rank.

Each rank writes the line its error boundary would print to a file of its own (`ERRORS_DIR` names the folder);
the launcher prints the lowest rank's. Under a plain `torchrun`, ranks print their errors themselves and torchrun
exits 1 for any failure.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

import click

ERRORS_DIR = "DEVMAP_RANK_ERRORS"  # environment: the folder where each rank writes "exit code<TAB>message"


def report_rank_error(message: str, code: int) -> bool:
    """Under this launcher, hand a rank's error to it (True: the launcher prints it); else False."""
    folder, rank = os.environ.get(ERRORS_DIR), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    (Path(folder) / f"rank{int(rank):05d}").write_text(f"{code}\t{message}")
    return True


def is_launched_rank() -> bool:
    """Whether this process is a rank this launcher started."""
    return bool(os.environ.get(ERRORS_DIR)) and os.environ.get("RANK") is not None


def end_launched_rank(code: int = 0) -> None:
    """End a rank this launcher started, whose command finished or whose error is reported, without the
    interpreter's teardown: a process group's threads (gloo's, NCCL's) can abort a process there ("terminate called
    without an active exception" on its stderr), and the launcher would then report a failure of a run that
    finished, or print that line beside the error's one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_arguments(argv: list[str]) -> list[str]:
    """The command line each rank runs (`python -m devmap ...`): this one without --nproc-per-node."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def launch(processes: int, argv: list[str], debug: bool = False) -> int:
    """Run `python -m devmap *argv` as `processes` ranks of one standalone job; their exit code for devmap's CLI."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets: ranks sharing a machine do not oversubscribe it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    if not debug:  # the agent logs each rank's end and the signals it sends; the one line below says what matters
        elastic.setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="devmap-ranks-") as folder:
        os.environ[ERRORS_DIR] = folder
        try:
            elastic_launch(config, sys.executable)(*["-u", "-m", "devmap", *argv])
            return 0
        except ChildFailedError as exc:
            reports = sorted(Path(folder).glob("rank*"))
            if reports:
                code, _, message = reports[0].read_text().partition("\t")
                click.echo(f"Error: {message}", err=True)
                return int(code)
            rank, failure = min(exc.failures.items())
            click.echo(f"Error: rank {rank} ended with exit code {failure.exitcode} before it could say why "
                       "(run with --debug, or under torchrun, for its output)", err=True)
            return 1
        finally:
            os.environ.pop(ERRORS_DIR, None)
            elastic.setLevel(level)


def relaunch(processes: int, command: str, flag: str) -> None:
    """Start `processes` ranks of this command line (`devmap COMMAND ...`, `flag` naming how many) and exit with
    their code when they fail (their error line is printed already)."""
    argv = sys.argv[1:]
    if command not in argv:
        raise click.UsageError(f"{flag} starts its processes from the command line: devmap {command} {flag} N ...")
    code = launch(processes, worker_arguments(argv), debug="--debug" in argv)
    if code:
        sys.exit(code)
