"""devmap: spread one PyTorch model over the GPUs of a machine, and make them work together."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module each lives in; imported on first use so that `import devmap`
# (and the CLI's --help) stays instant instead of importing torch and transformers.
_EXPORTS = {
    "plan": "devmap.planning.planner",
    "Plan": "devmap.planning.planner",
    "DeviceUsage": "devmap.planning.planner",
    "validate_device_map": "devmap.planning.planner",
    "STRATEGIES": "devmap.planning.placement",
    "load": "devmap.loading.loader",
    "pipeline": "devmap.pipelining",
    "Pipeline": "devmap.pipelining",
    "tune": "devmap.pipelining.tuning",
    "generate": "devmap.generation",
    "release_graphs": "devmap.generation.step_cache",
    "save": "devmap.loading.saver",
    "dispatch": "devmap.loading.loader",
    "LoadReport": "devmap.loading.loader",
    "resolve_source": "devmap.planning.models",
    "PRESETS": "devmap.planning.models",
    "parse_size": "devmap.planning.memory",
    "describe_environment": "devmap.planning.hardware",
    "DevmapError": "devmap.errors",
    "UsageError": "devmap.errors",
    "SourceError": "devmap.errors",
    "DoesNotFitError": "devmap.errors",
    "CheckpointError": "devmap.errors",
    "PipelineError": "devmap.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if _EXPORTS[name] != "devmap.errors":
            from .releases import require_supported

            require_supported()  # a library outside its tested range: one clear error before any work
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'devmap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
