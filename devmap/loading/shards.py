"""Which tensors a checkpoint holds and how they split into shards, as `save_pretrained` does: state_dict order,
tied aliases written once, a new shard when the next tensor would pass the size limit, transformers' file names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class TensorToWrite:
    """One tensor to write: its state_dict name, owning module, shape and the dtype it is written in."""

    name: str
    owner: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize


def plan_tensors(model: nn.Module, target: torch.dtype) -> tuple[list[TensorToWrite], set[str]]:
    """The state_dict entries to write, in order; tied aliases (lm_head.weight) are written once, under the
    first name, and returned apart. Non-persistent buffers (rotary inv_freq) are not in the state_dict."""
    entries: list[TensorToWrite] = []
    aliases: set[str] = set()
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
            continue
        seen.add(id(tensor))
        out_dtype = target if tensor.is_floating_point() else tensor.dtype
        entries.append(TensorToWrite(name, name.rpartition(".")[0], tuple(tensor.shape), out_dtype))
    return entries, aliases


def plan_shards(entries: list[TensorToWrite], limit: int) -> list[list[TensorToWrite]]:
    """Greedy in state_dict order, as save_pretrained does: a tensor larger than `limit` gets its own shard."""
    shards: list[list[TensorToWrite]] = []
    current: list[TensorToWrite] = []
    size = 0
    for entry in entries:
        if current and size + entry.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
