"""Room for a workload in a plan: the runtime bytes each placement unit holds for the whole run are counted with
its weights (so placement leaves room for them where the unit goes), every GPU keeps room for the largest
transient peak, and each device's share is reported apart (KV cache, activations, other)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .device_maps import owner_of
from .devices import DeviceKey, is_gpu
from .runtime_memory import UnitRuntime


@dataclass(frozen=True)
class DeviceRuntime:
    """A device's runtime bytes under a workload."""

    kv_cache: int = 0
    activations: int = 0  # saved for backward, plus the largest transient peak of its units
    other: int = 0  # gradients and optimizer state


def held_extras(model: nn.Module, runtime: dict[str, UnitRuntime]) -> dict[str, int]:
    """{tensor name: bytes} that put each unit's held runtime bytes on the unit's first tensor (the planner adds
    extra bytes per tensor, as it does for quantization scales)."""
    extras: dict[str, int] = {}
    for unit, needs in runtime.items():
        if not needs.held:
            continue
        module = model.get_submodule(unit) if unit else model
        first = next((n for n, _ in [*module.named_parameters(), *module.named_buffers()]), None)
        if first is not None:
            name = f"{unit}.{first}" if unit else first
            extras[name] = extras.get(name, 0) + needs.held
    return extras


def transient_room(runtime: dict[str, UnitRuntime]) -> int:
    """Bytes every GPU keeps free for the largest transient peak of any unit."""
    return max((needs.transient for needs in runtime.values()), default=0)


def gpu_limits_with_room(limits: dict[DeviceKey, int], room: int) -> dict[DeviceKey, int]:
    return {key: max(cap - room, 0) if is_gpu(key) else cap for key, cap in limits.items()}


def by_device(runtime: dict[str, UnitRuntime], placed: dict[str, DeviceKey]) -> dict[DeviceKey, DeviceRuntime]:
    """Each device's KV cache, activations and other runtime bytes under the placement."""
    sums: dict[DeviceKey, list[int]] = {}
    for unit, needs in runtime.items():
        owner = owner_of(unit, placed) if unit else ("" if "" in placed else None)
        if owner is None:
            continue
        kv, saved, peak, other = sums.setdefault(placed[owner], [0, 0, 0, 0])
        sums[placed[owner]] = [kv + needs.kv_cache, saved + needs.saved, max(peak, needs.transient),
                               other + needs.other]
    return {key: DeviceRuntime(kv, saved + peak, other) for key, (kv, saved, peak, other) in sums.items()}
