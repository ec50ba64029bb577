"""Starting a split service's shard processes (`--tensor-parallel N`) as the engine core's process starts, before it
imports anything heavy: each shard process imports its stack beside the core's instead of after it, so a split
service starts about as fast as a whole one. Light by design, as `core_start` is."""

from __future__ import annotations

import multiprocessing
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .core_parts import RegistrySettings
from .limits import EngineLimits


@dataclass
class StartedShards:
    """The N - 1 shard processes of a split, started: the group's address, and per process (rank 1 up) the process,
    the pipe of rank 0's calls, the pipe of its answers on loads and the pipe of its last words
    (`shards.ShardProcesses` takes them over)."""

    size: int
    address: str
    processes: list[Any] = field(default_factory=list)
    calls: list[Connection] = field(default_factory=list)
    replies: list[Connection] = field(default_factory=list)
    last_words: list[Connection] = field(default_factory=list)


def start_shards(settings: RegistrySettings, limits: EngineLimits, log_level: str) -> StartedShards:
    """Spawn ranks 1 to N - 1 (N: `settings.tensor_parallel`); they join the group once rank 0 does."""
    context = multiprocessing.get_context("spawn")
    started = StartedShards(settings.tensor_parallel, f"tcp://127.0.0.1:{_free_port()}")
    for rank in range(1, started.size):
        reads, writes = context.Pipe(duplex=False)
        replies, answers = context.Pipe(duplex=False)
        heard, said = context.Pipe(duplex=False)
        # not a daemon: its compiler starts processes of its own
        process = context.Process(target=_run, name=f"devmap-shard-{rank}",
                                  args=(rank, started.size, started.address, settings, limits, log_level, reads,
                                        answers, said))
        process.start()
        for end in (reads, answers, said):
            end.close()
        started.processes.append(process)
        started.calls.append(writes)
        started.replies.append(replies)
        started.last_words.append(heard)
    return started


def _run(*args: Any) -> None:  # a shard process's entry: its stack is imported here, in that process
    from .shard_worker import run_shard

    run_shard(*args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
