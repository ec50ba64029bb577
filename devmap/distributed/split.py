"""A model cut into consecutive stage modules, exactly as devmap's single-process pipeline cuts it.

The cut comes from a device map (consecutive units with one device key form a stage; residual blocks the map
splits between head and tail are cut there), from split points (block names that start a new stage), or
from a stage count (devmap's `balanced` planner over that many simulated GPUs). Nothing moves: the stage
modules share the model's parameters, and each rank later moves only its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import nn

from ..errors import PipelineError
from ..pipelining.residual_parts import parse_unit
from ..pipelining.stages import blocks_of, group_stages, placed_units, stage_module
from ..planning.device_maps import owner_of


@dataclass
class StageSplit:
    """The stages in order: their modules (nn.Sequential of units) and the unit names each holds."""

    modules: list[nn.Sequential]
    names: list[list[str]]
    device_map: dict[str, Any]

    def __len__(self) -> int:
        return len(self.modules)


def split_model(model: nn.Module, device_map: Mapping[str, Any] | None = None,
                split_points: Sequence[str] | None = None, stages: int | None = None,
                sample_shape: Sequence[int] | None = None) -> StageSplit:
    """Cut `model` (a torchvision ResNet or an nn.Sequential) into stages; give exactly one of device_map,
    split_points and stages. `stages` balances the blocks' FLOPs for one sample of `sample_shape` (without
    it, their parameter bytes)."""
    given = [x is not None for x in (device_map, split_points, stages)]
    if sum(given) != 1:
        raise PipelineError("say where to cut: give one of device_map, split_points or stages")
    if split_points is not None:
        device_map = _map_from_points(model, list(split_points))
    elif stages is not None:
        device_map = _balanced_map(model, stages, sample_shape)
    assert device_map is not None
    had = getattr(model, "hf_device_map", None)
    model.hf_device_map = dict(device_map)  # placed_units reads the cuts from it
    try:
        units = placed_units(model)
    finally:
        if had is None:
            del model.hf_device_map
        else:
            model.hf_device_map = had
    keys: list[Any] = []
    for name, module in units:  # the flatten before fc has no entry: it stays with the block before it
        key = _unit_key(name, module, device_map)
        keys.append(keys[-1] if key is _previous_key else key)
    groups = group_stages(units, keys)
    modules = [stage_module(blocks) for blocks, _ in groups]
    names = [[name for name, _ in blocks] for blocks, _ in groups]
    return StageSplit(modules, names, dict(device_map))


def _unit_key(name: str, module: nn.Module, device_map: Mapping[str, Any]) -> Any:
    base, role, _ = parse_unit(name)
    probe = f"{base}.{module.source_names[0]}" if role is not None else name  # type: ignore[union-attr]
    owner = owner_of(probe, dict(device_map))
    if owner is None:
        owner = next((k for k in device_map if k.startswith(probe + ".")), None)
        if owner is None:
            if name == "flatten":
                return _previous_key
            raise PipelineError(f"the device map does not place {name}; give every block a stage")
    return device_map[owner]


class _PreviousKey:
    """The flatten between avgpool and fc has no weights and no entry: it stays with the block before it."""


_previous_key = _PreviousKey()


def _map_from_points(model: nn.Module, points: list[str]) -> dict[str, Any]:
    blocks = [name for name, _ in blocks_of(model)]
    unknown = [p for p in points if p not in blocks and not any(b.startswith(p + ".") for b in blocks)]
    if unknown:
        raise PipelineError(f"split points {unknown} are not blocks of {type(model).__name__}; blocks are "
                            f"{', '.join(blocks[:6])}, ..., {blocks[-1]}")
    mapping, stage = {}, 0
    remaining = list(points)
    for name in blocks:
        if remaining and (name == remaining[0] or name.startswith(remaining[0] + ".")):
            stage += 1
            remaining.pop(0)
        if name != "flatten":
            mapping[name] = stage
    if remaining:
        raise PipelineError(f"split points must follow the model's order; {remaining} came out of order")
    return mapping


def _balanced_map(model: nn.Module, stages: int, sample_shape: Sequence[int] | None) -> dict[str, Any]:
    """Contiguous blocks per stage, minimizing the largest stage's FLOPs (or parameter bytes)."""
    from ..pipelining.balance import partition

    if stages < 1:
        raise PipelineError(f"stages must be at least 1, got {stages}")
    blocks = blocks_of(model)
    costs = _block_flops(blocks, model, sample_shape) if sample_shape is not None else [
        float(sum(p.numel() * p.element_size() for p in block.parameters())) for _, block in blocks]
    owner = partition([c + 1.0 for c in costs], stages)  # +1: blocks without cost still count a little
    return {name: stage for (name, _), stage in zip(blocks, owner) if name != "flatten"}


def _block_flops(blocks: list[tuple[str, nn.Module]], model: nn.Module, shape: Sequence[int]) -> list[float]:
    """FLOPs of each block for one sample (counted by torch's FlopCounterMode; on meta when the model is)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    x = torch.zeros(1, *shape, device=device)
    costs = []
    modes = {m: m.training for m in model.modules()}
    model.eval()  # no BatchNorm statistics touched, and one sample is enough
    try:
        with torch.no_grad():
            for _, block in blocks:
                counter = FlopCounterMode(display=False)
                with counter:
                    x = block(x)
                costs.append(float(counter.get_total_flops()))
    finally:
        for module, training in modes.items():
            module.training = training
    return costs
