"""Placement of a model's units in their order onto GPUs, measured in the planner's own bytes.

accelerate's `infer_auto_device_map` sizes modules by their weights alone; a workload's runtime bytes (KV cache,
activations kept for backward) are not proportional to weights (a ResNet's early blocks hold most of its
activations and few of its weights). So when a plan includes a workload, the units (no-split blocks and leaf
modules, in model order) are cut into contiguous runs per GPU by their full size: the smallest largest share
for `balanced` (GPU 0 weighted half for `balanced_low_0`), GPU after GPU for `sequential`.
"""

from __future__ import annotations

from torch import nn

from .devices import DeviceKey, is_gpu
from .placement import smallest_share


def contiguous_split(model: nn.Module, units: list[str], sizes: dict[str, int], limits: dict[DeviceKey, int],
                     strategy: str) -> dict[str, DeviceKey] | None:
    """{unit: GPU} with every unit on a GPU within its limit, or None (the caller falls back to offloading)."""
    from accelerate.utils import find_tied_parameters

    gpus = [k for k in limits if is_gpu(k) and limits[k] > 0]
    covered = {n for u in units for n in _tensor_names(model, u)}
    if not gpus or find_tied_parameters(model) or covered != set(_tensor_names(model, "")):
        return None  # ties and tensors outside the units are accelerate's to place
    loads = [sizes.get(unit, 0) for unit in units]

    def fill(caps: dict[DeviceKey, int]) -> dict[str, DeviceKey] | None:
        out: dict[str, DeviceKey] = {}
        g, used = 0, 0
        for unit, size in zip(units, loads):
            while g < len(gpus) and used + size > caps[gpus[g]]:
                g, used = g + 1, 0
            if g == len(gpus):
                return None
            out[unit] = gpus[g]
            used += size
        return out

    if strategy == "sequential":
        return fill(limits)
    weights = {g: 0.5 if strategy == "balanced_low_0" and len(gpus) > 1 and g == gpus[0] else 1.0 for g in gpus}

    def caps(share: float) -> dict[DeviceKey, int]:
        return {g: min(int(weights[g] * share), limits[g]) for g in gpus}

    total = sum(loads)
    return smallest_share(lambda share: fill(caps(share)), total / sum(weights.values()),
                          max(limits[g] / weights[g] for g in gpus), total)


def _tensor_names(model: nn.Module, unit: str) -> list[str]:
    module = model.get_submodule(unit) if unit else model
    prefix = f"{unit}." if unit else ""
    return [prefix + n for n, _ in [*module.named_parameters(), *module.named_buffers()]]
