"""Refusing, before it runs, a workload that will not fit beside a placed model's weights: the runtime bytes each
GPU will hold for it (KV cache, activations, gradients and optimizer state, measured as plans measure them:
`runtime_memory`) against what that GPU has free now (the driver's free memory plus what torch's allocator holds
unused)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DoesNotFitError
from . import hardware
from .devices import DeviceKey, device_label, is_gpu, parse_device_key
from .memory import format_bytes
from .models import default_no_split
from .runtime_memory import runtime_by_unit
from .runtime_room import by_device
from .workload import Workload


def short_of(needs: dict[DeviceKey, int], what: str = "") -> list[str]:
    """"SIZE[what] on DEVICE with FREE free" for each GPU (index: bytes) that cannot hold what it needs now."""
    short = []
    for index, size in needs.items():
        free = hardware.free_for_torch(int(index))
        if size > free:
            short.append(f"{format_bytes(size)}{what} on {device_label(index)} with {format_bytes(free)} free")
    return short


def check_runtime_room(model: nn.Module, workload: Workload, what: str) -> None:
    """Raise DoesNotFitError, with the numbers per GPU, when `workload` will not fit on the placed `model`."""
    placed = {name: parse_device_key(device) for name, device in getattr(model, "hf_device_map", {}).items()}
    if not any(is_gpu(key) for key in placed.values()):
        return
    plan = getattr(model, "devmap_plan", None)
    no_split = plan.no_split_module_classes if plan is not None else default_no_split(model)
    causal = hasattr(model, "lm_head") and hasattr(model, "model")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    runtime = runtime_by_unit(model, workload, dtype, no_split, causal)
    needs = {key: device.kv_cache + device.activations + device.other
             for key, device in by_device(runtime, placed).items() if is_gpu(key)}
    short = short_of(needs)
    if short:
        raise DoesNotFitError(
            f"{what} for {workload.describe()} needs {'; '.join(short)} (KV cache, activations, gradients and "
            "optimizer state beside the weights). Use a smaller workload, or load the model with room for it "
            "(devmap.load(..., workload=...), devmap plan --for ...)")
