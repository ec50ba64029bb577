"""The loader service: models kept on their devices, concurrent requests batched continuously, and an
OpenAI-compatible HTTP API over them (FastAPI + uvicorn).

Data flows app (HTTP) -> engine (requests, text) -> core client -> core (the loop: scheduler, continuous batches,
tokens) -> generation. The core runs in a process of its own under `devmap serve` (`core_client.ProcessCore`), or
in a thread (`Engine(registry)`); split over N GPUs (`--tensor-parallel N`) the core's process is rank 0 and N-1
shard processes repeat its every model call (`shards`, `shard_worker`). Owns: the registry of resident models (loads
under a model root, budgets, unloads), the scheduler (pure policy), the request and response formats, metrics, the
compile cache's folder and the app. Imports generation, loading and planning; only the CLI imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

# public names and their modules, imported on first use: `devmap serve` starts the engine core's process from the
# light ones (`core_start`, `core_parts`, `limits`) before the rest imports torch and transformers
_EXPORTS = {"Engine": "engine", "EngineLimits": "limits", "GenerationParams": "jobs", "ModelRegistry": "registry",
            "RegistrySettings": "core_parts", "ResidentModel": "resident"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
