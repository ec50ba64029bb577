"""What this machine has: GPUs, their memory and peer links, host memory, library versions (the only module that
probes devices)."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..bytecode import bytecode_advice, recompiled_packages
from ..releases import releases



@dataclass
class GPUInfo:
    """One visible CUDA device."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: str


@dataclass
class Environment:
    """A snapshot of the devices and software devmap sees."""

    gpus: list[GPUInfo]
    peer_access: dict[str, bool]
    cpu_total_bytes: int
    cpu_available_bytes: int
    cpu_count: int
    python: str
    versions: dict[str, str | None]
    cuda: str | None
    releases: list[dict[str, Any]] = field(default_factory=list)  # each library against its tested range
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data."""
        return asdict(self)


def gpu_count() -> int:
    """Number of visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_capability(index: int) -> tuple[int, int] | None:
    """The CUDA compute capability of visible GPU `index` (None if there is no such GPU)."""
    return torch.cuda.get_device_capability(index) if 0 <= index < gpu_count() else None


def start_gpus_in_background() -> threading.Thread | None:
    """Create every visible GPU's CUDA context on a helper thread, so that it overlaps work the caller does
    meanwhile (a cold load imports transformers' model classes first). Errors surface later, when the caller
    asks the devices themselves."""
    if gpu_count() == 0:
        return None

    def touch() -> None:
        with contextlib.suppress(Exception):
            for index in range(gpu_count()):
                torch.cuda.mem_get_info(index)

    thread = threading.Thread(target=touch, name="devmap-cuda-init", daemon=True)
    thread.start()
    return thread


def free_for_torch(index: int) -> int:
    """Bytes torch can still allocate on CUDA device `index`: the driver's free memory plus what torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(index)
    return int(free) + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)


def gpu_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `index`."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, read from /proc/meminfo where it exists."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def describe_environment() -> Environment:
    """Probe GPUs (name, memory, peer access between each pair), host memory and package versions."""
    gpus = []
    for i in range(gpu_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = gpu_memory(i)
        gpus.append(GPUInfo(i, props.name, total, free, f"{props.major}.{props.minor}"))
    peers = {
        f"{a}->{b}": bool(torch.cuda.can_device_access_peer(a, b))
        for a in range(len(gpus))
        for b in range(len(gpus))
        if a != b
    }
    available, total = host_memory()
    found = releases()
    notes = [] if gpus else ["no CUDA GPU is visible: plan with --gpus N --gpu-memory SIZE to simulate GPUs"]
    if recompiled := recompiled_packages():
        notes.append(bytecode_advice(recompiled))
    return Environment(
        gpus=gpus,
        peer_access=peers,
        cpu_total_bytes=total,
        cpu_available_bytes=available,
        cpu_count=os.cpu_count() or 1,
        python=platform.python_version(),
        versions={r.package: r.version for r in found},
        cuda=torch.version.cuda,
        releases=[{"package": r.package, "version": r.version, "tested": r.tested, "supported": r.supported}
                  for r in found],
        notes=notes,
    )
