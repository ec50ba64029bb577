"""Which models' warm-ups have run whole with the region store in use, so that a later start skips their pass over
every join shape.

A warm-up (`warm_up.warm_up`) runs a small batch's steps at every pack width and row count before the model serves, so
that the shapes whose code is compiled anew (a first start) are compiled there rather than in the first requests. Once
a warm-up has run whole, its model's compiled regions are in the store (`generation.region_store`), and a later start
of the same model on the same card loads them: its warm-up then needs its decode step and its first join only (loading
the entries and their kernels), and the serving batch's own pass runs every shape it meets. A marker per model (its
config; the store's key for each GPU of its map: devmap's sources, the releases, the card; dtype, quantization, batch
and thread count) is kept in the store's `warmed/` folder; a warm-up that finds one runs light, and removes it where
it compiled anything all the same (the store lost entries), so that the next start runs the whole pass again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from ..generation.region_store import entries_key, store_folder
from ..planning.devices import is_gpu, parse_device_key


def warm_key(model: nn.Module, rows: int, context: int, riding: bool | None) -> str | None:
    """The marker's name for `model`'s warm-up with that batch, or None where no store is in use, the model is not on
    GPUs alone or it is split over processes."""
    plan = getattr(model, "devmap_plan", None)
    if store_folder() is None or getattr(plan, "tensor_parallel", None) is not None:
        return None  # a split's processes warm up in step: each runs the whole pass
    cards = {}
    for name, device in sorted(getattr(model, "hf_device_map", {"": "cpu"}).items()):
        key = parse_device_key(device)
        if not is_gpu(key):
            return None
        cards[name] = entries_key(key)  # devmap's sources, the releases, the card
    quantization = getattr(getattr(plan, "quantization", None), "scheme", None)
    described = {"config": model.config.to_dict(), "cards": cards,
                 "dtype": str(model.get_input_embeddings().weight.dtype), "quantization": quantization, "rows": rows,
                 "context": context, "riding": riding, "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _marker(key: str) -> Path | None:
    folder = store_folder()
    return None if folder is None else folder / "warmed" / f"{key}.done"


def warmed(key: str | None) -> bool:
    """Whether a warm-up of `key` ran whole before."""
    marker = _marker(key) if key else None
    return marker is not None and marker.exists()


def mark(key: str | None, whole: bool) -> None:
    """Record that a warm-up of `key` ran whole (`whole`), or that its light run compiled something (the marker goes:
    the next start runs the whole pass). A disk that refuses leaves things as they were."""
    marker = _marker(key) if key else None
    if marker is None:
        return
    try:
        if whole:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)
    except OSError:
        pass
