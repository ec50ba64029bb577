"""What the engine core's process is made from and reached by: the settings its registry is built from, and the
started process with its pipes. Light (no torch, no transformers): the API's process holds these before it imports its
own stack (`core_start`)."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass(frozen=True)
class RegistrySettings:
    """What the engine core's process builds its `ModelRegistry` from (see its arguments)."""

    model_root: str | None = None
    device_map: Any = "balanced"
    max_memory: Any = None
    dtype: str | None = None
    quantization: Any = None
    random_weights: bool = False
    tensor_parallel: int = 1  # > 1: every model split over that many processes, one per GPU (`serving.shards`)


@dataclass
class StartedCore:
    """An engine core's process, started: the process, the pipe to it and the pipe from it (`core_client.ProcessCore`
    takes them over)."""

    process: Any
    to_core: Connection
    from_core: Connection
