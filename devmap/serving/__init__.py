"""The loader service: models kept on their devices, concurrent requests batched continuously, and an
OpenAI-compatible HTTP API over them (FastAPI + uvicorn).

Data flows app (HTTP) -> engine (requests, text) -> core client -> core (the loop: scheduler, continuous batches,
tokens) -> generation. The core runs in a process of its own under `devmap serve` (`core_client.ProcessCore`), or
in a thread (`Engine(registry)`); split over N GPUs (`--tensor-parallel N`) the core's process is rank 0 and N-1
shard processes repeat its every model call (`shards`, `shard_worker`). Owns: the registry of resident models (loads
under a model root, budgets, unloads), the scheduler (pure policy), the request and response formats, metrics and the
app. Imports generation, loading and planning; only the CLI imports this package.
"""

from __future__ import annotations

from .core_client import RegistrySettings
from .engine import Engine
from .limits import EngineLimits
from .jobs import GenerationParams
from .registry import ModelRegistry
from .resident import ResidentModel

__all__ = ["Engine", "EngineLimits", "GenerationParams", "ModelRegistry", "RegistrySettings", "ResidentModel"]
