"""Memory budgets per device: real GPUs and host memory, simulated GPUs, or an explicit max_memory."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Mapping

from . import hardware
from ..errors import UsageError
from .devices import DeviceKey, device_label, is_gpu
from .memory import Size, parse_max_memory, parse_size

# Like transformers, keep 10% of each real GPU's free memory for activations when the user sets no budget.
REAL_GPU_FRACTION = 0.9
# Simulated GPUs per plan: far above any machine, low enough that a typo cannot make planning loop for minutes.
MAX_GPUS = 4096


@dataclass
class Budget:
    """Bytes each device may hold, in placement order: GPUs by index, then cpu, then disk."""

    limits: dict[DeviceKey, int]
    simulated: bool

    @property
    def gpus(self) -> list[int]:
        return [k for k in self.limits if is_gpu(k)]

    def label(self) -> str:
        """ "cuda:0 20.00 GiB, cpu 64.00 GiB"; runs of GPUs with one budget as "cuda:0-7 80.00 GiB each". """
        from .memory import format_bytes

        parts: list[str] = []
        gpus = self.gpus
        start = 0
        while start < len(gpus):
            end = start
            while (end + 1 < len(gpus) and gpus[end + 1] == gpus[end] + 1
                   and self.limits[gpus[end + 1]] == self.limits[gpus[start]]):
                end += 1
            size = format_bytes(self.limits[gpus[start]])
            parts.append(f"cuda:{gpus[start]} {size}" if end == start else
                         f"cuda:{gpus[start]}-{gpus[end]} {size} each")
            start = end + 1
        parts += [f"{k} {format_bytes(v)}" for k, v in self.limits.items() if not is_gpu(k)]
        return ", ".join(parts)


def _ordered(limits: Mapping[DeviceKey, int]) -> dict[DeviceKey, int]:
    gpus = sorted(k for k in limits if is_gpu(k))
    return {k: limits[k] for k in [*gpus, *(d for d in ("cpu", "disk") if d in limits)]}


def resolve_budget(
    max_memory: str | Mapping[DeviceKey, Size] | None = None,
    gpus: int | None = None,
    gpu_memory: Size | None = None,
    offload_folder: str | None = None,
) -> Budget:
    """Budgets from simulated GPUs (`gpus` x `gpu_memory`), an explicit `max_memory`, or this machine's devices.

    - `gpus` + `gpu_memory`: that many simulated GPUs; cpu and disk only where `max_memory` names them.
    - `max_memory` alone: exactly the devices it names (GPU indices may be simulated).
    - nothing: each real GPU at 90% of its free memory, plus the host's available memory.
    With an `offload_folder` and no disk budget, disk is allowed up to the free space of that folder's filesystem.
    """
    overrides = parse_max_memory(max_memory)
    real_gpus = hardware.gpu_count()
    totals: dict[DeviceKey, int | None] = {}
    limits: dict[DeviceKey, int] = {}
    simulated = False

    if gpu_memory is not None and gpus is None:
        raise UsageError("--gpu-memory needs --gpus N: say how many GPUs to simulate")
    if gpus is not None:
        if gpus < 1 or gpus > MAX_GPUS:
            raise UsageError(f"invalid --gpus {gpus}: the number of GPUs must be at least 1 and at most {MAX_GPUS}")
        if gpu_memory is None:
            if real_gpus < gpus:
                raise UsageError(
                    f"--gpus {gpus} without --gpu-memory needs {gpus} real GPUs, but {real_gpus} are visible; "
                    "add --gpu-memory SIZE (e.g. 80GiB) to simulate them"
                )
            for i in range(gpus):
                free, total = hardware.gpu_memory(i)
                totals[i], limits[i] = total, int(free * REAL_GPU_FRACTION)
        else:
            size = parse_size(gpu_memory, what="--gpu-memory")
            if size <= 0:
                raise UsageError(f"invalid --gpu-memory {gpu_memory!r}: a GPU needs more than 0 bytes")
            simulated = True
            for i in range(gpus):
                totals[i], limits[i] = size, size
    elif not overrides:
        for i in range(real_gpus):
            free, total = hardware.gpu_memory(i)
            totals[i], limits[i] = total, int(free * REAL_GPU_FRACTION)
        available, _ = hardware.host_memory()
        limits["cpu"] = available

    for key, raw in overrides.items():
        if key not in totals:
            totals[key] = _device_total(key, real_gpus, offload_folder)
        if is_gpu(key) and key >= real_gpus and gpus is None:
            simulated = True
        limits[key] = parse_size(raw, total=totals[key], what=f"memory for {device_label(key)}")
    if offload_folder is not None and "disk" not in limits:
        # as in transformers: naming an offload folder allows disk, bounded by that filesystem's free space
        limits["disk"] = shutil.disk_usage(_existing_parent(offload_folder)).free
    return Budget(limits=_ordered(limits), simulated=simulated)


def _device_total(key: DeviceKey, real_gpus: int, offload_folder: str | None) -> int | None:
    if is_gpu(key):
        return hardware.gpu_memory(key)[1] if key < real_gpus else None
    if key == "cpu":
        return hardware.host_memory()[1]
    return shutil.disk_usage(_existing_parent(offload_folder or ".")).total


def _existing_parent(path: str) -> str:
    from pathlib import Path

    p = Path(path).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)
