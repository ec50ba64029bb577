"""A per-layer table in the spirit of torchsummary: type, output shape, params, bytes and device of each leaf module."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .devices import device_label
from .llama_layout import is_layout
from .device_maps import owner_of
from .planner import Plan
from .quantization import quantized_weights, weight_extra_bytes


@dataclass
class LayerRow:
    """One leaf module of the model."""

    name: str
    type: str
    output_shape: list[int] | None
    params: int
    bytes: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shape(output: Any) -> list[int] | None:
    if isinstance(output, torch.Tensor):
        return list(output.shape)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return list(output[0].shape)
    shape = getattr(output, "shape", None)
    return list(shape) if shape is not None else None


def layer_table(plan: Plan, input_shape: tuple[int, ...] | None = None) -> list[LayerRow]:
    """Run the plan's meta model on a meta input of `input_shape` and list every leaf module it called."""
    if plan.model is None or plan.model_source is None:
        raise UsageError("this plan carries no model; compute it with devmap.plan()")
    model, source = plan.model, plan.model_source
    if is_layout(model):  # a plan of a LLaMA model's weights placed its layout, which does not run
        model = source.build("meta")
    shapes: dict[str, list[int] | None] = {}
    hooks = []
    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    def record(name: str):  # a forward hook that returns None, so the output passes through unchanged
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            shapes.setdefault(name, _shape(output))

        return hook

    for name, module in leaves:
        hooks.append(module.register_forward_hook(record(name)))
    try:
        with torch.no_grad():
            model(source.sample_input(input_shape, device="meta"))
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        reason = str(exc).splitlines()[0]
        raise UsageError(f"the model cannot run on an input of shape {input_shape}: {reason}") from None
    finally:
        for hook in hooks:
            hook.remove()
    element = torch.tensor([], dtype=plan.dtype).element_size()
    quantized = set(quantized_weights(model, plan.quantization)) if plan.quantization else set()
    rows = []
    for name, module in leaves:
        tensors = list(module.named_parameters(prefix=name, recurse=False))
        params = sum(p.numel() for _, p in tensors)
        nbytes = sum(p.numel() * plan.quantization.bits // 8 + weight_extra_bytes(plan.quantization, *p.shape)
                     if n in quantized else p.numel() * (element if p.is_floating_point() else p.element_size())
                     for n, p in tensors)
        owner = owner_of(name, plan.device_map)
        device = device_label(plan.device_map[owner]) if owner is not None else "?"
        rows.append(LayerRow(name, type(module).__name__, shapes.get(name), params, nbytes, device))
    return rows


def parse_shape(text: str) -> tuple[int, ...]:
    """"1,3,224,224" or "1x3x224x224" -> (1, 3, 224, 224)."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts if p.strip())
    except ValueError:
        raise UsageError(f"invalid input shape {text!r}: expected integers such as 1,3,224,224") from None
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"invalid input shape {text!r}: every dimension must be a positive integer")
    return shape

