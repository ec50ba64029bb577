"""The device key: where a block lives, in one form everywhere below the user's input.

A key is a GPU index (`0`, `1`, ...), `"cpu"` or `"disk"` — what accelerate's `device_map` values and
`max_memory` keys are. User input in any form transformers accepts (`0`, `"0"`, `"cuda:1"`, `torch.device`) is
parsed once, by `parse_device_key`; after that, code compares keys, turns them into labels for people
(`device_label`) or into torch devices (`torch_device`), and never parses a label back.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

from ..errors import UsageError

DeviceKey = Union[int, str]


def parse_device_key(key: DeviceKey | torch.device) -> DeviceKey:
    """0, "0", "cuda:0", torch.device("cuda", 0) -> 0; "cpu" and "disk" stay."""
    if isinstance(key, bool):
        raise UsageError(f"unknown device {key!r}: use a GPU index (0, 1, ...), cuda:N, cpu or disk")
    if isinstance(key, int):
        if key < 0:
            raise UsageError(f"unknown device {key!r}: a GPU index cannot be negative")
        return key
    if isinstance(key, torch.device):
        key = str(key)
    text = str(key).strip().lower()
    if text in ("cpu", "disk"):
        return text
    if text == "cuda":
        return 0
    if text.startswith("cuda:"):
        text = text[5:]
    if text.isascii() and text.isdigit():  # "²".isdigit() is true, and int() refuses it
        return int(text)
    raise UsageError(f"unknown device {key!r}: use a GPU index (0, 1, ...), cuda:N, cpu or disk")


def device_label(key: DeviceKey) -> str:
    """The key as people and torch write it: 0 -> "cuda:0", "cpu" -> "cpu", "disk" -> "disk"."""
    return f"cuda:{key}" if isinstance(key, int) else str(key)


def torch_device(key: DeviceKey, disk_as_cpu: bool = False) -> torch.device:
    """The torch device a key's tensors live on; a disk block's tensors are made in host memory first
    (`disk_as_cpu`), else disk is refused (nothing runs there)."""
    if isinstance(key, int):
        return torch.device("cuda", key)
    if key == "disk" and not disk_as_cpu:
        raise UsageError("nothing runs on disk: blocks offloaded to disk are moved to a device when they run")
    return torch.device("cpu")


def is_gpu(key: DeviceKey) -> bool:
    return isinstance(key, int)


def offloaded(keys: Iterable[DeviceKey]) -> bool:
    """Whether a placement offloads: something on disk, or on the CPU beside GPUs."""
    used = set(keys)
    return "disk" in used or ("cpu" in used and any(is_gpu(k) for k in used))
