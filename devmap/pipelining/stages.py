"""Split a model into an ordered list of blocks, and blocks into stages of consecutive blocks on one device."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence, Union

import torch
from torch import nn

from ..errors import PipelineError
from ..planning.devices import parse_device_key, torch_device

Block = tuple[str, nn.Module]
StageSpec = tuple[nn.Module, Union[str, int, torch.device]]


def as_device(device: Union[str, int, torch.device]) -> torch.device:
    """0, "cuda:0", "cpu", torch.device -> torch.device."""
    if isinstance(device, torch.device):
        return device
    key = parse_device_key(device)
    if key == "disk":
        raise PipelineError("a pipeline stage cannot run on disk: offloaded blocks cannot be pipelined")
    return torch_device(key)


def blocks_of(model: nn.Module) -> list[Block]:
    """The model's forward as a sequence of blocks, finest first-level granularity (ResNet: each Bottleneck).

    torchvision ResNets (whose forward flattens before `fc`) and nn.Sequential models are supported;
    anything else cannot be split without knowing its forward.
    """
    from torchvision.models import ResNet
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


def split_units(blocks: list[Block]) -> list[Block]:
    """Every residual block as its head and tail at its default cut (the finest units a stage boundary can
    fall between)."""
    from .residual_parts import split_residual, unit_name

    units: list[Block] = []
    for name, block in blocks:
        parts = split_residual(block)
        units += [(name, block)] if parts is None else [(unit_name(name, "head", block), parts[0]),
                                                         (unit_name(name, "tail", block), parts[1])]
    return units


def merge_units(units: list[Block], devices: list[torch.device], blocks: list[Block]) -> tuple[list[Block],
                                                                                              list[torch.device]]:
    """Head and tail of one block on the same device become the whole block again (no stacking between them)."""
    from .residual_parts import parse_unit

    whole = dict(blocks)
    out_units: list[Block] = []
    out_devices: list[torch.device] = []
    k = 0
    while k < len(units):
        base, role, _ = parse_unit(units[k][0])
        if role == "head" and devices[k] == devices[k + 1]:
            assert parse_unit(units[k + 1][0])[:2] == (base, "tail")
            out_units.append((base, whole[base]))
            out_devices.append(devices[k])
            k += 2
            continue
        out_units.append(units[k])
        out_devices.append(devices[k])
        k += 1
    return out_units, out_devices


def placement_entries(units: list[Block], devices: list[torch.device]) -> dict[str, int | str]:
    """hf_device_map entries for units: a cut block is placed by the submodules each part runs."""
    from .residual_parts import parse_unit

    entries: dict[str, int | str] = {}
    for (name, module), device in zip(units, devices):
        value: int | str = device.index if device.type == "cuda" else device.type  # type: ignore[assignment]
        if name == "flatten":
            continue
        base, role, _ = parse_unit(name)
        if role is not None:
            entries.update({f"{base}.{child}": value for child in module.source_names})  # type: ignore[union-attr]
        else:
            entries[name] = value
    return entries


def apply_units(model: nn.Module, units: list[Block], devices: list[torch.device]) -> None:
    """Move each unit to its device and make the model's hf_device_map say so."""
    for (_, module), device in zip(units, devices):
        module.to(device)
    model.hf_device_map = placement_entries(units, devices)


def whole_block_devices(model: nn.Module) -> tuple[list[Block], list[torch.device]]:
    """The model's whole blocks and their devices (a cut block counts as on its head's device)."""
    from .residual_parts import parse_unit

    units = placed_units(model)
    unit_devices = block_devices(model, units)
    return blocks_of(model), [d for (name, _), d in zip(units, unit_devices) if parse_unit(name)[1] != "tail"]


def placed_units(model: nn.Module) -> list[Block]:
    """The model's blocks, with each residual block that the device map cuts between head and tail as its two parts."""
    from .residual_parts import cuts_of, head_tail_names, split_residual, unit_name

    device_map = getattr(model, "hf_device_map", None) or {}
    units: list[Block] = []
    for name, block in blocks_of(model):
        inner = {k: v for k, v in device_map.items() if k.startswith(name + ".")}
        for cut in cuts_of(block) if inner and name not in device_map else []:
            head_names, tail_names = head_tail_names(block, cut)  # type: ignore[misc]
            head_devices = {inner.get(f"{name}.{n}") for n in head_names}
            tail_devices = {inner.get(f"{name}.{n}") for n in tail_names}
            if len(head_devices) == 1 and len(tail_devices) == 1 and head_devices != tail_devices \
                    and set(inner) <= {f"{name}.{n}" for n in head_names + tail_names}:
                head, tail = split_residual(block, cut)  # type: ignore[misc]
                units += [(unit_name(name, "head", block, cut), head), (unit_name(name, "tail", block, cut), tail)]
                break
        else:
            units.append((name, block))
    return units


def block_devices(model: nn.Module, blocks: list[Block]) -> list[torch.device]:
    """Each block's device, read from the model's placement (hf_device_map) or from its parameters."""
    from .residual_parts import parse_unit

    device_map = getattr(model, "hf_device_map", None)
    devices = []
    for name, module in blocks:
        if device_map and parse_unit(name)[1] is not None:
            param = next(module.parameters())
            devices.append(param.device)
        elif device_map:
            from ..planning.device_maps import owner_of

            owner = owner_of(name, device_map)
            if owner is None:
                inner = [k for k in device_map if k.startswith(name + ".")]
                if inner:
                    raise PipelineError(
                        f"block {name} is split over devices by the device map ({', '.join(inner[:3])}); "
                        "keep each block whole (no-split classes), or cut a ResNet block between its "
                        "head and tail only, to pipeline it"
                    )
                devices.append(devices[-1] if devices else torch.device("cpu"))
                continue
            devices.append(as_device(device_map[owner]))
        else:
            param = next(module.parameters(), None)
            devices.append(param.device if param is not None else (devices[-1] if devices else torch.device("cpu")))
    return devices


def group_stages(blocks: list[Block], devices: list[Any]) -> list[tuple[list[Block], Any]]:
    """Consecutive blocks on one device (or with one stage key) form a stage."""
    stages: list[tuple[list[Block], torch.device]] = []
    for block, device in zip(blocks, devices):
        if stages and stages[-1][1] == device:
            stages[-1][0].append(block)
        else:
            stages.append(([block], device))
    return stages


def stage_module(blocks: list[Block]) -> nn.Sequential:
    """A stage's blocks as one nn.Sequential, children named after the units ("layer2.0[head]" -> "layer2_0_head")."""
    return nn.Sequential(OrderedDict(
        (name.replace(".", "_").replace("[", "_").replace("]", "").replace("@", "_"), block) for name, block in blocks))


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
