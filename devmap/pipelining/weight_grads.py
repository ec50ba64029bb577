"""Weight gradients computed apart from input gradients, so a pipeline stage can pass its input gradient on first.

A stage's backward has two halves: the input gradient (which the previous stage waits for) and the weight
gradients (which nothing waits for until the optimizer step). Computing the input half for every
micro-batch first and the weight half afterwards lets the weight half fill the pipeline's drain, where a
stage would otherwise sit idle (the "zero bubble" idea). The split covers Linear and zero-padded
convolutions: the gradient at each such module's output is kept by the input half, and the weight half
turns it into weight and bias gradients with the module's recorded input.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

SPLITTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class Call:
    """One forward call of a splittable module: its input, its output, and the output's state after the call."""

    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor
    version: int
    grad_fn: Any
    input_version: int


def _weight_and_bias(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]


def splittable(module: nn.Module) -> bool:
    """Whether the module's weight gradient can be computed from its recorded input and output gradient."""
    if type(module) not in SPLITTABLE:  # a subclass may compute something else in its forward
        return False
    if isinstance(module, nn.modules.conv._ConvNd) and (module.padding_mode != "zeros"
                                                         or isinstance(module.padding, str)):
        return False
    return bool(module.weight.requires_grad)


class CallRecorder:
    """Records every call of the splittable modules under `root` while entered (forward hooks)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.calls: list[Call] = []
        self._handles: list[Any] = []

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            self.calls.append(Call(module, args[0], output, output._version, output.grad_fn, args[0]._version))

    def __enter__(self) -> "CallRecorder":
        self.calls = []
        self._handles = [m.register_forward_hook(self._hook) for m in self.root.modules() if splittable(m)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def deferrable(root: nn.Module, calls: list[Call]) -> list[Call]:
    """The calls whose weight half can be deferred: the module ran once, owns its parameters alone, and its
    output and input were not changed in place afterwards (the gradient kept must be the one at the module's
    output, and the input the one it saw)."""
    runs = Counter(id(call.module) for call in calls)
    owners = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    kept = []
    for call in calls:
        if (runs[id(call.module)] == 1 and all(owners[id(p)] == 1 for p in _weight_and_bias(call.module))
                and call.output.requires_grad and call.output._version == call.version
                and call.output.grad_fn is call.grad_fn and call.input._version == call.input_version):
            kept.append(call)
    return kept


def deferred_parameters(calls: list[Call]) -> set[int]:
    """ids of the parameters whose gradients the weight half computes."""
    return {id(p) for call in calls for p in _weight_and_bias(call.module) if p.requires_grad}


def weight_grads(calls: list[Call], output_grads: list[torch.Tensor | None]
                 ) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, gradient) of each deferred call's weight and bias, from the gradient at its output."""
    for call, grad in zip(calls, output_grads):
        if grad is None:  # the output did not reach the loss: its parameters get no gradient from this call
            continue
        module = call.module
        bias = getattr(module, "bias", None)
        want_bias = bias is not None and bias.requires_grad
        if isinstance(module, nn.Linear):
            g = grad.reshape(-1, grad.shape[-1])
            yield module.weight, g.t().mm(call.input.reshape(-1, call.input.shape[-1]))
            if want_bias:
                yield bias, g.sum(0)
            continue
        dims = call.input.dim() - 2
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, call.input, module.weight, [module.out_channels] if want_bias else None,
            list(module.stride), list(module.padding), list(module.dilation), False, [0] * dims, module.groups,
            [False, True, want_bias])
        yield module.weight, grad_weight
        if want_bias:
            yield bias, grad_bias


def input_half(out: torch.Tensor, grad_out: torch.Tensor, inputs: list[torch.Tensor], params: list[torch.Tensor],
               calls: list[Call], retain: bool = False) -> tuple[list, list, list]:
    """Gradients of `inputs`, of `params` (those outside the deferred calls) and at each deferred call's output."""
    grads = list(torch.autograd.grad(out, inputs + params + [call.output for call in calls], grad_out,
                                     allow_unused=True, retain_graph=retain))
    return grads[:len(inputs)], grads[len(inputs):len(inputs) + len(params)], grads[len(inputs) + len(params):]


def split_grads(out: torch.Tensor, grad_out: torch.Tensor, inputs: list[torch.Tensor], params: list[torch.Tensor],
                calls: list[Call], retain: bool = False) -> tuple[list, list]:
    """Both halves at once, eagerly: gradients of `inputs` and of every parameter in `params` (None if unused)."""
    deferred = deferred_parameters(calls)
    early = [p for p in params if id(p) not in deferred]
    input_grads, early_grads, output_grads = input_half(out, grad_out, inputs, early, calls, retain)
    found: dict[int, torch.Tensor] = {id(p): g for p, g in zip(early, early_grads) if g is not None}
    for p, g in weight_grads(calls, output_grads):
        found[id(p)] = g if id(p) not in found else found[id(p)] + g
    return input_grads, [found.get(id(p)) for p in params]


def close(expected: torch.Tensor | None, actual: torch.Tensor | None, tolerance: float = 1e-2) -> bool:
    """Whether two gradients agree (relative to the expected one's norm; TF32 kernels differ a little)."""
    if expected is None or actual is None:
        return expected is None and actual is None
    if expected.shape != actual.shape:
        return False
    expected, actual = expected.detach().float(), actual.detach().float()
    return float((expected - actual).norm()) <= tolerance * float(expected.norm()) + 1e-6
