"""A resident model: one model on its devices with its tokenizer, what its serving plan made room for (rows and
cache tokens), the shape its batches settled on (kept for its next start), and whether it is being unloaded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..planning.devices import DeviceKey
from .kv_budget import KVBudget
from .load_phases import CompiledGraphs
from .scheduler import BatchShape
from .step_compile import StepCompile
from .warm_marks import ServedShapes


@dataclass
class ResidentModel:
    """A model on its devices with its tokenizer; `busy` is held while a batch runs on it."""

    id: str
    path: Path
    model: nn.Module
    tokenizer: Any
    created: int
    context: int
    vocab_size: int  # token ids its embedding has rows for: a prompt's ids are below it
    planned: dict[DeviceKey, int]  # bytes per device (weights, KV cache, activations) at its largest batch
    report: dict[str, Any]
    max_rows: int = 1  # rows its memory plan fits at `cache_len` (lanes × the service's max_batch at most); batches of
    # shorter caches hold more rows in the same KV tokens (`kv_budget`)
    cache_len: int = 0  # cache tokens per row its plan made room for
    lanes: int = 1  # the lanes its batches run in, each up to the service's max_batch rows (`load_plan`)
    compiled: bool = False  # its decode steps run as torch.compile code (devmap.serving.warm_up)
    compiling: StepCompile | None = None  # its steps' compile while it serves (`step_compile`), once started
    eos_ids: tuple[int, ...] = ()  # tokens that end a request (the model's generation config and its tokenizer)
    last_used: float = field(default_factory=time.monotonic)
    busy: threading.Lock = field(default_factory=threading.Lock)
    batch_shape: BatchShape = field(default_factory=BatchShape)  # the largest continuous batch so far: later
    # ones reuse its shape (and its captured steps)
    warm_key: str | None = None  # where the shapes it serves at are kept for its next start (`warm_marks`)
    kept_shapes: ServedShapes | None = None  # the shapes last kept there
    load_seconds: dict[str, float] = field(default_factory=dict)  # per phase of its load (`load_phases`)
    compiled_graphs: CompiledGraphs | None = None  # what its compile made, and how much of it the compile cache held
    unload_at: float | None = None  # being unloaded: its running requests are ended at this time.monotonic()

    def drained(self) -> bool:
        """Whether its unload has waited its drain bound: nothing more runs on it."""
        return self.unload_at is not None and time.monotonic() >= self.unload_at

    @property
    def kv_budget(self) -> KVBudget:
        """The KV cache its plan made room for: `max_rows` rows of `cache_len` tokens, or more rows of shorter
        caches, in `lanes` lanes."""
        return KVBudget(self.max_rows, self.cache_len, self.lanes)

    @property
    def kv_room(self) -> int:
        """Bytes its plan made room for in KV caches (all devices): its batches' kept caches stay within them."""
        from ..planning.runtime_memory import layer_kv_bytes

        config = self.model.config
        dtype = self.model.get_input_embeddings().weight.dtype
        return config.num_hidden_layers * layer_kv_bytes(config, dtype, self.max_rows, self.cache_len)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "devmap",
                "path": str(self.path), "context_length": self.context, "vocab_size": self.vocab_size,
                "max_batch": self.max_rows, "lanes": self.lanes,
                "cache_tokens_per_row": self.cache_len, "kv_cache_tokens": self.kv_budget.tokens,
                "compiled": self.compiled, "compiling": self.compiling is not None and self.compiling.running,
                "load_seconds": dict(self.load_seconds),  # a copy: a compile beside serving adds to it
                "compiled_graphs": self.compiled_graphs._asdict() if self.compiled_graphs else None,
                "device_map": {k: str(v) for k, v in self.model.hf_device_map.items()}}
