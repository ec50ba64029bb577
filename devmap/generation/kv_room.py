"""Refusing, before anything is allocated, a generation whose KV caches will not fit: each GPU stage's caches
(rows × tokens on each of its layers, `planning.runtime_memory.layer_kv_bytes`) against what that GPU has free
now (the driver's free memory plus what torch's allocator holds unused). A load planned for the workload
(`devmap.load(..., workload=...)`) leaves this room."""

from __future__ import annotations

from ..errors import DoesNotFitError
from ..planning.runtime_check import short_of
from ..planning.runtime_memory import layer_kv_bytes
from .causal_lm import CausalLMStages


def check_kv_room(stages: CausalLMStages, rows: int, tokens: int, what: str) -> None:
    """Raise DoesNotFitError, with the numbers per GPU, when the caches of `rows` × `tokens` do not fit."""
    needs: dict[int, int] = {}
    for stage in stages.stages:
        if stage.device.type == "cuda":
            index = stage.device.index or 0
            needs[index] = needs.get(index, 0) + len(stage.layers) * layer_kv_bytes(stages.config, stages.dtype,
                                                                                      rows, tokens)
    short = short_of(needs, " of KV cache")
    if short:
        raise DoesNotFitError(
            f"{what} of {rows} rows × {tokens} tokens needs {'; '.join(short)}. Lower the batch or the new tokens, "
            "free what other shapes' kept steps hold (devmap.release_graphs(model)), or load the model with room "
            "for it (devmap.load(..., workload=...), devmap plan --for generate)")
