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

The marker also holds the shapes the model served at (`ServedShapes`: the batch shape its batches settled on and the
join shapes its steps met there), written as a batch of a new shape or with new join shapes ends: a light warm-up
runs its batch at that shape and makes those steps, so that the first batch after a restart replays steps captured
before it answered instead of capturing its own in the middle of its first requests (docs/serving.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..generation.region_store import entries_key, store_folder
from ..generation.joins import JoinShape
from ..planning.devices import is_gpu, parse_device_key
from .scheduler import BatchShape

log = logging.getLogger("devmap.serving")


@dataclass(frozen=True)
class ServedShapes:
    """The batch shape a model's batches settled on (`ResidentModel.batch_shape`) and the join shapes its steps met at
    that shape (`ContinuousBatch.join_shapes`)."""

    batch: BatchShape
    joins: tuple[JoinShape, ...] = ()


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


def served_shapes(key: str | None, context: int) -> ServedShapes | None:
    """The shapes a model of `key` (of `context` tokens, 0: unbounded) served at when it last ran, or None (none
    recorded yet; an unreadable or impossible record is ignored with a warning: the warm-up then runs its small
    batch)."""
    marker = _marker(key) if key else None
    try:
        text = marker.read_text() if marker is not None else ""
    except OSError:  # no marker (no whole warm-up), or a disk that refuses
        return None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
        batch = BatchShape(*(int(record["batch"][name]) for name in ("rows", "first_slot", "cache_len")))
        joins = tuple(sorted((int(rows), int(width)) for rows, width in record["joins"]))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the served shapes kept in %s (%s: %s); the warm-up runs a small batch", marker,
                    type(exc).__name__, exc)
        return None
    possible = (batch.rows >= 1 and 0 < batch.first_slot <= batch.cache_len
                and (not context or batch.cache_len <= context)
                and all(rows >= 0 and width >= 1 for rows, width in joins))
    if not possible:
        log.warning("ignoring the served shapes kept in %s (%s): not a batch of this model", marker, record)
        return None
    return ServedShapes(batch, joins)


def remember(key: str | None, shapes: ServedShapes) -> None:
    """Keep the shapes a model of `key` serves at in its marker, where a warm-up ran whole (a marker exists): replaced
    whole (a crash leaves the old record or the new one). A disk that refuses leaves things as they were."""
    marker = _marker(key) if key else None
    if marker is None or not marker.exists():
        return
    record = {"batch": {"rows": shapes.batch.rows, "first_slot": shapes.batch.first_slot,
                        "cache_len": shapes.batch.cache_len}, "joins": [list(shape) for shape in shapes.joins]}
    partial = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(record))
        os.replace(partial, marker)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
