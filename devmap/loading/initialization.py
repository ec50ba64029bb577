"""Random initialization of a module's own tensors in place, on whatever device they live (no CPU copy of the model)."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_module_(module: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Initialize `module`'s own parameters (not its children's).

    LLaMA-style (as transformers does): Linear and Embedding weights ~ N(0, std), biases 0, norm weights 1.
    ResNet-style (as torchvision does): Conv2d weights kaiming-normal (fan_out, relu), BatchNorm weight 1
    and bias 0, running statistics reset.
    """
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, nn.Conv2d):
        fan_out = module.out_channels * math.prod(module.kernel_size) // module.groups
        params["weight"].normal_(0.0, math.sqrt(2.0 / fan_out), generator=generator)
        if "bias" in params and params["bias"] is not None:
            params["bias"].zero_()
        return
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.affine:
            params["weight"].fill_(1.0)
            params["bias"].zero_()
        if module.track_running_stats and module.running_mean is not None:
            module.reset_running_stats()
        return
    for name, param in params.items():
        if name == "bias":
            param.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            param.normal_(0.0, std, generator=generator)
        elif "norm" in type(module).__name__.lower() and name == "weight":
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
