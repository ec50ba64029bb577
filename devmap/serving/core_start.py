"""Starting the engine core's process before anything heavy is imported: `devmap serve` starts it first, so that the
core's imports and model loads run while this process imports its own stack (HTTP, tokenizers), not after.

Light by design: nothing here, nor in what the core is started with (`RegistrySettings`, `EngineLimits`), imports
torch or transformers; the core's process imports its stack itself (`core_client.run_core_process`).
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Sequence

from .core_parts import RegistrySettings, StartedCore
from .limits import EngineLimits


def start_core(settings: RegistrySettings, limits: EngineLimits, log_level: str = "WARNING",
               models: Sequence[str] = ()) -> StartedCore:
    """Spawn the engine core's process (it owns the GPUs; this process never touches CUDA); `models`: directories
    it starts loading as soon as its imports are done (`EngineCore.load_early`: the service's command line), for this
    process to `load` once its own imports are."""
    context = multiprocessing.get_context("spawn")
    core_reads, to_core = context.Pipe(duplex=False)
    from_core, core_writes = context.Pipe(duplex=False)
    # not a daemon: the core's compiler starts worker processes of its own
    process = context.Process(target=_run, name="devmap-engine-core",
                              args=(settings, limits, log_level, core_reads, core_writes, time.time(), tuple(models)))
    process.start()
    core_reads.close()
    core_writes.close()
    return StartedCore(process, to_core, from_core)


def _run(settings: RegistrySettings, limits: EngineLimits, log_level: str, inbox: Connection, outbox: Connection,
         spawned_at: float, models: tuple[str, ...]) -> None:
    """The spawned process's entry: a split's shard processes start first, then this process imports its stack."""
    shards = None
    if settings.tensor_parallel > 1:
        from .shard_start import start_shards

        shards = start_shards(settings, limits, log_level)
    from .core_client import run_core_process

    run_core_process(settings, limits, log_level, inbox, outbox, spawned_at, shards=shards, models=models)
