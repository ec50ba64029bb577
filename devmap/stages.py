"""Split a model into an ordered list of blocks, and blocks into stages of consecutive blocks on one device."""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

from .errors import PipelineError
from .memory import parse_device_key

Block = tuple[str, nn.Module]
StageSpec = tuple[nn.Module, Union[str, int, torch.device]]


def as_device(device: Union[str, int, torch.device]) -> torch.device:
    """0, "cuda:0", "cpu", torch.device -> torch.device."""
    if isinstance(device, torch.device):
        return device
    key = parse_device_key(device)
    if key == "disk":
        raise PipelineError("a pipeline stage cannot run on disk: offloaded blocks cannot be pipelined")
    return torch.device("cpu") if key == "cpu" else torch.device("cuda", key)


def blocks_of(model: nn.Module) -> list[Block]:
    """The model's forward as a sequence of blocks, finest first-level granularity (ResNet: each Bottleneck).

    torchvision ResNets (whose forward flattens before `fc`) and nn.Sequential models are supported;
    anything else cannot be split without knowing its forward.
    """
    try:
        from torchvision.models import ResNet
    except ImportError:  # pragma: no cover - torchvision is a dependency
        ResNet = ()  # type: ignore[assignment,misc]
    if isinstance(model, ResNet):
        blocks: list[Block] = [(n, getattr(model, n)) for n in ("conv1", "bn1", "relu", "maxpool")]
        for layer in ("layer1", "layer2", "layer3", "layer4"):
            blocks += [(f"{layer}.{i}", b) for i, b in enumerate(getattr(model, layer))]
        return blocks + [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    if isinstance(model, nn.Sequential):
        blocks = []
        for name, child in model.named_children():
            if isinstance(child, nn.Sequential) and len(child) > 0:
                blocks += [(f"{name}.{n}", c) for n, c in child.named_children()]
            else:
                blocks.append((name, child))
        return blocks
    raise PipelineError(
        f"cannot split a {type(model).__name__} into pipeline stages: its forward is not a sequence of its "
        "children (devmap splits nn.Sequential models and torchvision ResNets); pass explicit stages as "
        "[(module, device), ...] instead"
    )


def block_devices(model: nn.Module, blocks: list[Block]) -> list[torch.device]:
    """Each block's device, read from the model's placement (hf_device_map) or from its parameters."""
    device_map = getattr(model, "hf_device_map", None)
    devices = []
    for name, module in blocks:
        if device_map:
            from .planner import owner_of

            owner = owner_of(name, device_map)
            if owner is None:
                inner = [k for k in device_map if k.startswith(name + ".")]
                if inner:
                    raise PipelineError(
                        f"block {name} is split over devices by the device map ({', '.join(inner[:3])}); "
                        "keep each block whole (no-split classes) to pipeline it"
                    )
                devices.append(devices[-1] if devices else torch.device("cpu"))
                continue
            devices.append(as_device(device_map[owner]))
        else:
            param = next(module.parameters(), None)
            devices.append(param.device if param is not None else (devices[-1] if devices else torch.device("cpu")))
    return devices


def group_stages(blocks: list[Block], devices: list[torch.device]) -> list[tuple[list[Block], torch.device]]:
    """Consecutive blocks on one device form a stage."""
    stages: list[tuple[list[Block], torch.device]] = []
    for block, device in zip(blocks, devices):
        if stages and stages[-1][1] == device:
            stages[-1][0].append(block)
        else:
            stages.append(([block], device))
    return stages


def check_stage_devices(stages: Sequence[StageSpec]) -> list[tuple[nn.Module, torch.device]]:
    """Explicit stages: every parameter and buffer of a stage must sit on its declared device."""
    if not stages:
        raise PipelineError("a pipeline needs at least one stage")
    checked = []
    for index, spec in enumerate(stages):
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], nn.Module)):
            raise PipelineError(f"stage {index} must be a (module, device) pair, got {type(spec).__name__}")
        module, device = spec[0], as_device(spec[1])
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.device.type == "meta":
                raise PipelineError(f"stage {index} has no weights ({name} is on meta): load or dispatch it first")
            if _normalize(tensor.device) != _normalize(device):
                raise PipelineError(
                    f"stage {index} is declared on {device} but its {name} is on {tensor.device}; "
                    f"move the module with .to('{device}') or declare its real device"
                )
        checked.append((module, device))
    return checked


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
