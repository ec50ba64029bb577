"""The PyTorch model-parallel tutorial's systems (ResNet50 whole, split, pipelined; ToyModel) for any device list."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import Tensor, nn
from torchvision.models.resnet import Bottleneck, ResNet

from ..errors import UsageError

Device = Union[str, torch.device]

# The ordered top-level children of torchvision's ResNet; a placement gives each one a device index.
RESNET_CHILDREN: tuple[str, ...] = (
    "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc",
)
# The tutorial's split: conv1 … layer2 on the first device, layer3 … fc on the second.
TUTORIAL_SPLIT: tuple[int, ...] = (6,)
# Default stage boundaries for other device counts (the tutorial only defines two devices).
DEFAULT_SPLITS: dict[int, tuple[int, ...]] = {1: (), 2: TUTORIAL_SPLIT, 3: (5, 7), 4: (5, 6, 7)}

Stage = tuple[Callable[[Tensor], Tensor], torch.device]


def placement_from_split(split: Sequence[int], num_devices: int) -> list[int]:
    """Stage boundaries over RESNET_CHILDREN -> a device index per child (stage k on device k).

    `split=(6,)` puts children[0:6] on device 0 and children[6:] on device 1 (the tutorial).
    """
    bounds = [int(b) for b in split]
    if any(not 0 < b < len(RESNET_CHILDREN) for b in bounds) or bounds != sorted(set(bounds)):
        raise UsageError(f"invalid split {list(split)}: boundaries must increase strictly "
                         f"within 1..{len(RESNET_CHILDREN) - 1}")
    if len(bounds) + 1 > num_devices:
        raise UsageError(f"split {bounds} makes {len(bounds) + 1} stages but only {num_devices} devices were given")
    return [sum(i >= b for b in bounds) for i in range(len(RESNET_CHILDREN))]


def placement_from_device_map(device_map: Mapping[str, object], num_devices: int) -> list[int]:
    """A {module name: device index} map (top-level children or sub-blocks such as "layer4.1") -> one index per child.

    Rounding: each top-level child goes, whole, to the device of its *first* entry in the map's
    order (an entry naming the child, one of its sub-blocks, or a parent such as "" for the whole
    model). A planner map that splits layer4 as layer4.0 -> 0, layer4.1 -> 1 thus puts all of
    layer4 on device 0. Values are indices into the device list; "cpu" or "disk" are refused.
    """
    placement = []
    for child in RESNET_CHILDREN:
        value = next(
            (v for k, v in device_map.items()
             if k in ("", child) or k.startswith(child + ".") or child.startswith(k + ".")),
            None,
        )
        if value is None:
            raise UsageError(f"device map places no part of {child!r}: give every ResNet50 child a device")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_devices:
            raise UsageError(
                f"device map puts {child!r} on {value!r}: the comparison needs a device index in 0..{num_devices - 1} "
                "(cpu or disk offload is not supported here)"
            )
        placement.append(value)
    return placement


def default_placement(num_devices: int) -> list[int]:
    """The tutorial's split for two devices (DEFAULT_SPLITS for 1, 3 or 4); more devices need an explicit split."""
    if num_devices not in DEFAULT_SPLITS:
        raise UsageError(f"no default ResNet50 split for {num_devices} devices: give a split or a device map")
    return placement_from_split(DEFAULT_SPLITS[num_devices], num_devices)


def _as_devices(devices: Sequence[Device]) -> list[torch.device]:
    if not devices:
        raise UsageError("no devices given")
    return [torch.device(d) for d in devices]


def resolve_placement(devices: Sequence[Device], device_map: str | Mapping[str, Any] | None) -> list[int]:
    """A device index per ResNet50 child: the tutorial's split, a planner strategy, or an explicit map.

    A strategy is planned by `devmap.plan("resnet50", strategy, max_memory={i: total memory of
    devices[i] (80 GiB for cpu)})`; its map is rounded to whole top-level children (see
    placement_from_device_map).
    """
    if device_map is None:
        return default_placement(len(devices))
    devices = _as_devices(devices)
    if isinstance(device_map, str):
        from ..planning.hardware import gpu_memory
        from ..planning.planner import plan

        budget = {i: gpu_memory(d.index)[1] if d.type == "cuda" else 80 * 2**30 for i, d in enumerate(devices)}
        device_map = plan("resnet50", device_map, max_memory=budget).device_map
    return placement_from_device_map(device_map, len(devices))


def run_stages(stages: Sequence[Stage], x: Tensor) -> Tensor:
    """Model parallel: the whole batch through each stage in turn, moved to each stage's device first."""
    for fn, device in stages:
        x = fn(x.to(device))
    return x


def pipeline_stages(stages: Sequence[Stage], x: Tensor, split_size: int) -> Tensor:
    """The tutorial's pipelined forward, generalized from two stages to any number.

    The batch is cut with `x.split(split_size)`. At each tick the later stages run first, on the older
    micro-batches, then the first stage takes the next micro-batch; every stage output is sent to the
    next stage's device at once. For two stages this is exactly the tutorial's loop (seq2 and fc on
    the previous micro-batch, then seq1 on the next, then torch.cat). A split size at or above the
    batch size gives one micro-batch, i.e. no pipelining, as in the tutorial.
    """
    micro = x.to(stages[0][1]).split(split_size, dim=0)
    count, depth = len(micro), len(stages)
    acts: dict[int, Tensor] = {}
    ret: list[Tensor] = []
    for tick in range(count + depth - 1):
        for s in reversed(range(depth)):
            m = tick - s
            if not 0 <= m < count:
                continue
            out = stages[s][0](micro[m] if s == 0 else acts.pop(m))
            if s + 1 < depth:
                acts[m] = out.to(stages[s + 1][1])
            else:
                ret.append(out)
    return torch.cat(ret)


class StageModule(nn.Module):
    """One stage: some of the model's children in order, and the flatten + fc when the stage holds fc."""

    def __init__(self, body: Sequence[nn.Module], fc: nn.Module | None = None) -> None:
        super().__init__()
        self.body = nn.Sequential(*body)
        self.fc = fc

    def forward(self, x: Tensor) -> Tensor:
        x = self.body(x)
        return x if self.fc is None else self.fc(x.view(x.size(0), -1))


class ModelParallelResNet50(ResNet):
    """The tutorial's ModelParallelResNet50 over any devices: contiguous runs of RESNET_CHILDREN form stages.

    `placement` gives a device index per child (default: the tutorial's split, layer2 | layer3).
    The state dict has torchvision's resnet50 keys, so weights load across from a plain resnet50.
    The flatten before fc is kept: fc sees `x.view(x.size(0), -1)`.
    """

    def __init__(self, devices: Sequence[Device], placement: Sequence[int] | None = None,
                 num_classes: int = 1000) -> None:
        super().__init__(Bottleneck, [3, 4, 6, 3], num_classes=num_classes)
        self.devices = _as_devices(devices)
        self.placement = list(placement) if placement is not None else default_placement(len(self.devices))
        if len(self.placement) != len(RESNET_CHILDREN) or not all(0 <= p < len(self.devices) for p in self.placement):
            raise UsageError(f"invalid placement {self.placement}: one device index per child of {RESNET_CHILDREN}")
        runs: list[tuple[list[str], int]] = []
        for name, index in zip(RESNET_CHILDREN, self.placement):
            getattr(self, name).to(self.devices[index])
            if runs and runs[-1][1] == index:
                runs[-1][0].append(name)
            else:
                runs.append(([name], index))
        # Plain tuples, not submodules: the registered children stay torchvision's, so state dicts match.
        self.stage_layout: tuple[tuple[tuple[str, ...], torch.device], ...] = tuple(
            (tuple(names), self.devices[index]) for names, index in runs
        )
        # Stage modules only refer to the children (no cycle back to self), so dropped models free at once.
        self.stages: tuple[Stage, ...] = tuple(
            (StageModule([getattr(self, n) for n in names if n != "fc"], self.fc if "fc" in names else None), dev)
            for names, dev in self.stage_layout
        )

    def forward(self, x: Tensor) -> Tensor:
        return run_stages(self.stages, x)


class PipelineParallelResNet50(ModelParallelResNet50):
    """The tutorial's PipelineParallelResNet50: micro-batches of `split_size` (default 20) pipelined over the stages."""

    def __init__(self, devices: Sequence[Device], placement: Sequence[int] | None = None,
                 num_classes: int = 1000, split_size: int = 20) -> None:
        super().__init__(devices, placement, num_classes)
        self.split_size = split_size

    def forward(self, x: Tensor) -> Tensor:
        return pipeline_stages(self.stages, x, self.split_size)


def single_resnet50(device: Device, num_classes: int = 1000) -> nn.Module:
    """The tutorial's baseline: `torchvision.models.resnet50(num_classes=...)` on one device."""
    import torchvision.models as models

    return models.resnet50(num_classes=num_classes).to(device)


class ToyModel(nn.Module):
    """The tutorial's ToyModel: net1 = Linear(10, 10) on devices[0], relu, net2 = Linear(10, 5) on devices[1].

    With one device (or the same device twice) both layers share it: that is the toy's single-device baseline.
    """

    def __init__(self, devices: Sequence[Device]) -> None:
        super().__init__()
        self.devices = _as_devices(devices)
        self.dev0, self.dev1 = self.devices[0], self.devices[1 if len(self.devices) > 1 else 0]
        self.net1 = torch.nn.Linear(10, 10).to(self.dev0)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5).to(self.dev1)
        self.stages: tuple[Stage, ...] = ((StageModule([self.net1, self.relu]), self.dev0),
                                          (StageModule([self.net2]), self.dev1))

    def forward(self, x: Tensor) -> Tensor:
        return run_stages(self.stages, x)


class PipelineToyModel(ToyModel):
    """ToyModel with the tutorial's pipelined forward (micro-batches of `split_size`)."""

    def __init__(self, devices: Sequence[Device], split_size: int = 20) -> None:
        super().__init__(devices)
        self.split_size = split_size

    def forward(self, x: Tensor) -> Tensor:
        return pipeline_stages(self.stages, x, self.split_size)
