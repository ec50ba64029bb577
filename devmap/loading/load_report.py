"""What a load reports: per device the blocks, planned and allocated bytes, time and GB/s, and for the whole load
the checkpoint, the bytes read, the bytes mapped (host tensors that are views of their file: `file_maps`) and the
tensors it had to initialize."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DeviceLoad:
    """What loading put on one device."""

    device: str
    blocks: int
    planned_bytes: int
    allocated_bytes: int | None
    seconds: float

    @property
    def gb_per_s(self) -> float | None:
        return self.planned_bytes / self.seconds / 1e9 if self.seconds > 0 and self.planned_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "planned_bytes": self.planned_bytes, "allocated_bytes": self.allocated_bytes,
                "seconds": self.seconds, "gb_per_s": self.gb_per_s}


@dataclass
class LoadReport:
    """How a load went: the checkpoint, the time, the bytes, and per device what landed there."""

    source: str
    checkpoint: str | None
    random_init: bool
    dtype: str
    seconds: float
    bytes_read: int
    devices: dict[str, DeviceLoad]
    initialized: list[str] = field(default_factory=list)
    offload_folder: str | None = None
    mapped_bytes: int = 0  # host tensors left as views of their checkpoint file, read on first use

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "checkpoint": self.checkpoint, "random_init": self.random_init,
            "dtype": self.dtype, "seconds": self.seconds, "bytes_read": self.bytes_read,
            "mapped_bytes": self.mapped_bytes,
            "gb_per_s": self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else None,
            "devices": {k: v.to_dict() for k, v in self.devices.items()},
            "initialized": self.initialized, "offload_folder": self.offload_folder,
        }
