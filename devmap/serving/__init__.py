"""The loader service: models kept on their devices, concurrent requests batched into devmap's lanes, and an
OpenAI-compatible HTTP API over them (FastAPI + uvicorn).

Owns: the registry of resident models (loads under a model root, budgets, unloads), the scheduler (pure
policy) and the engine loop that runs continuous batches, the request and response formats, metrics and the app. Imports generation, loading and planning; only the
CLI imports this package.
"""

from __future__ import annotations

from .engine import Engine
from .limits import EngineLimits
from .jobs import GenerationParams
from .registry import ModelRegistry, ResidentModel

__all__ = ["Engine", "EngineLimits", "GenerationParams", "ModelRegistry", "ResidentModel"]
