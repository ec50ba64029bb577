"""A plan as its callers read it: the device map with what each device holds, the map's runs of entries on one device,
and the pipeline stages a causal LM's decoder layers form on it. `planner` makes plans; everything else reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .budget import Budget
from .devices import DeviceKey, device_label
from .memory import dtype_name
from .models import ModelSource
from .placement import DeviceMap
from .quantization import Quantization
from .tensor_parallel import TensorSplit
from .workload import Workload

LAYER_ENTRY = re.compile(r"(^|\.)layers\.\d+$")  # a device-map entry placing one decoder layer


@dataclass
class DeviceUsage:
    """What one device holds under a plan: `key` is the device key (`devmap.planning.devices`), `device` its label."""

    device: str
    modules: list[str]
    params: int
    bytes: int
    budget: int | None
    key: DeviceKey = "cpu"
    kv_cache_bytes: int = 0  # what the plan's workload needs beside the weights (zero without one)
    activation_bytes: int = 0
    other_bytes: int = 0

    @property
    def total(self) -> int:
        """Weights plus the workload's runtime bytes."""
        return self.bytes + self.kv_cache_bytes + self.activation_bytes + self.other_bytes

    @property
    def share(self) -> float | None:
        """Fraction of the budget used (None for an unbudgeted device)."""
        return self.total / self.budget if self.budget else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "modules": self.modules,
            "blocks": len(self.modules),
            "params": self.params,
            "bytes": self.bytes,
            "weights_bytes": self.bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "activation_bytes": self.activation_bytes,
            "other_bytes": self.other_bytes,
            "total_bytes": self.total,
            "budget": self.budget,
            "share": self.share,
        }


@dataclass
class Run:
    """Consecutive device-map entries on one device: `first … last → device`."""

    first: str
    last: str
    device: str
    count: int

    def __str__(self) -> str:
        span = self.first if self.count == 1 else f"{self.first} … {self.last}"
        return f"{span or '(whole model)'} → {self.device}"


@dataclass
class Plan:
    """A device map with its per-device report. `model` is the meta-device model it was computed on: for a plan of a
    LLaMA model's weights alone, its layout (`devmap.planning.llama_layout`: transformers' names and shapes, and its
    `config`, but no forward)."""

    source: str
    strategy: str
    dtype: torch.dtype
    device_map: DeviceMap
    devices: dict[str, DeviceUsage]
    total_params: int
    total_bytes: int
    budget: Budget
    no_split_module_classes: list[str]
    warnings: list[str] = field(default_factory=list)
    quantization: Quantization | None = None
    unquantized_bytes: int | None = None  # the model's size at `dtype` alone, when quantized
    workload: Workload | None = None  # what running needs is planned too (devmap.planning.workload)
    tensor_parallel: TensorSplit | None = None  # blocks split over groups of GPUs (the map names each group's first)
    model: nn.Module | None = field(default=None, repr=False, compare=False)
    model_source: ModelSource | None = field(default=None, repr=False, compare=False)

    @property
    def runs(self) -> list[Run]:
        """The map condensed into contiguous runs of entries on one device, in model order."""
        runs: list[Run] = []
        for name, device in self.device_map.items():
            label = device_label(device)
            if runs and runs[-1].device == label:
                runs[-1].last, runs[-1].count = name, runs[-1].count + 1
            else:
                runs.append(Run(name, name, label, 1))
        return runs

    @property
    def stages(self) -> int:
        """The pipeline stages a causal LM's decoder layers run in (`generation.CausalLMStages` splits them the same
        way): runs of consecutive `layers.N` entries on one device; 1 where no entry places a decoder layer alone."""
        devices = [device_label(device) for name, device in self.device_map.items() if LAYER_ENTRY.search(name)]
        return max(1, sum(1 for i, device in enumerate(devices) if i == 0 or devices[i - 1] != device))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: device_map (HF style: GPU index, "cpu", "disk") and per-device usage."""
        return {
            "source": self.source,
            "strategy": self.strategy,
            "dtype": dtype_name(self.dtype),
            "quantization": self.quantization.to_dict() if self.quantization else None,
            "unquantized_bytes": self.unquantized_bytes,
            "workload": self.workload.to_dict() if self.workload else None,
            "tensor_parallel": self.tensor_parallel.to_dict() if self.tensor_parallel else None,
            "device_map": dict(self.device_map),
            "devices": {name: usage.to_dict() for name, usage in self.devices.items()},
            "runs": [{"first": r.first, "last": r.last, "device": r.device, "count": r.count} for r in self.runs],
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
            "budget": {device_label(k): v for k, v in self.budget.limits.items()},
            "simulated": self.budget.simulated,
            "no_split_module_classes": self.no_split_module_classes,
            "warnings": self.warnings,
        }
