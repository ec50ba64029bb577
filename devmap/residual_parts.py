"""A ResNet residual block cut in two, so a pipeline stage boundary can fall inside it.

Whole blocks are too coarse to balance two stages of ResNet50 (the best whole-block split at 224² is
66.7 vs 55.2 ms). The head runs the block's convolutions up to the cut and its downsample; it hands the
tail one tensor, the cut activation and the identity stacked along channels (they share their spatial
size); the tail runs the rest and the residual sum. Together they compute exactly the block's forward.
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_SUFFIX, TAIL_SUFFIX = "[head]", "[tail]"


def _kind(block: nn.Module) -> str | None:
    try:
        from torchvision.models.resnet import BasicBlock, Bottleneck
    except ImportError:  # pragma: no cover - torchvision is a dependency
        return None
    if isinstance(block, Bottleneck):
        return "bottleneck"
    if isinstance(block, BasicBlock):
        return "basic"
    return None


def head_tail_names(block: nn.Module) -> tuple[list[str], list[str]] | None:
    """The submodules (with weights) each part runs, or None for a block devmap cannot cut."""
    kind = _kind(block)
    if kind is None:
        return None
    extra = ["downsample"] if getattr(block, "downsample", None) is not None else []
    if kind == "bottleneck":  # cut after conv2: the 3x3 convolution and the 1x1 before it on the head
        return ["conv1", "bn1", "conv2", "bn2", *extra], ["conv3", "bn3"]
    return ["conv1", "bn1", *extra], ["conv2", "bn2"]


class ResidualHead(nn.Module):
    """The block up to its cut, plus its identity (downsampled when the block downsamples), stacked on channels.

    It holds only the block's submodules it runs (shared with the block), so it moves to its stage's device
    without taking the tail's weights along."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        names = head_tail_names(block)
        assert names is not None
        self.bottleneck = _kind(block) == "bottleneck"
        self.source_names = names[0]  # the block's submodules this part runs (how a device map places it)
        for name in names[0]:
            setattr(self, name, getattr(block, name))
        self.has_downsample = "downsample" in names[0]
        self.relu = block.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        if self.bottleneck:
            out = self.relu(self.bn2(self.conv2(out)))
        identity = self.downsample(x) if self.has_downsample else x
        return torch.cat([out, identity], dim=1)


class ResidualTail(nn.Module):
    """The rest of the block from the head's stacked tensor."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        names = head_tail_names(block)
        assert names is not None
        self.bottleneck = _kind(block) == "bottleneck"
        self.source_names = names[1]
        self.conv, self.bn = (block.conv3, block.bn3) if self.bottleneck else (block.conv2, block.bn2)
        self.relu = block.relu
        self.split = self.conv.in_channels

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        out, identity = packed[:, :self.split], packed[:, self.split:]
        return self.relu(self.bn(self.conv(out)) + identity)


def split_residual(block: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(head, tail) sharing the block's modules, or None where the block is not a ResNet residual block."""
    if head_tail_names(block) is None:
        return None
    return ResidualHead(block), ResidualTail(block)
