"""A ResNet residual block cut in two, so a pipeline stage boundary can fall inside it.

Whole blocks are too coarse to balance two stages of ResNet50 (the best whole-block split leaves one stage
about a fifth slower than the other). The head runs the block's convolutions up to the cut (and its downsample);
it hands the tail one tensor, the cut activation and the identity stacked along channels (they share their spatial
size); the tail runs the rest and the residual sum. Together they compute exactly the block's forward.

A Bottleneck is cut after conv2 (its default cut) or, when it does not downsample, also after conv1; a
BasicBlock after conv1. Units are named "layer2.0[head]" / "layer2.0[tail]" for a block's default cut
and "layer2.1[head@conv1]" / "layer2.1[tail@conv1]" for another.
"""

from __future__ import annotations

import torch
from torch import nn


def _kind(block: nn.Module) -> str | None:
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if isinstance(block, Bottleneck):
        return "bottleneck"
    if isinstance(block, BasicBlock):
        return "basic"
    return None


def cuts_of(block: nn.Module) -> list[str]:
    """Where the block can be cut (the first is its default), none for a block devmap cannot cut."""
    kind = _kind(block)
    if kind == "bottleneck":
        return ["conv2"] if block.downsample is not None else ["conv2", "conv1"]
    return ["conv1"] if kind == "basic" else []


def head_tail_names(block: nn.Module, cut: str | None = None) -> tuple[list[str], list[str]] | None:
    """The submodules (with weights) each part runs at this cut (default: the block's first), or None."""
    cuts = cuts_of(block)
    cut = cut or (cuts[0] if cuts else None)
    if cut not in cuts:
        return None
    extra = ["downsample"] if block.downsample is not None else []
    if _kind(block) == "basic":
        return ["conv1", "bn1", *extra], ["conv2", "bn2"]
    if cut == "conv2":  # the 3x3 convolution and the 1x1 before it on the head
        return ["conv1", "bn1", "conv2", "bn2", *extra], ["conv3", "bn3"]
    return ["conv1", "bn1"], ["conv2", "bn2", "conv3", "bn3"]


def unit_name(block_name: str, role: str, block: nn.Module, cut: str | None = None) -> str:
    """"layer2.0[head]" for the default cut, "layer2.1[head@conv1]" for another."""
    cuts = cuts_of(block)
    suffix = "" if cut is None or cut == cuts[0] else f"@{cut}"
    return f"{block_name}[{role}{suffix}]"


def parse_unit(name: str) -> tuple[str, str | None, str | None]:
    """(block name, "head" / "tail" / None, cut or None for the default) of a unit name."""
    if not name.endswith("]") or "[" not in name:
        return name, None, None
    base, part = name[:-1].split("[", 1)
    role, _, cut = part.partition("@")
    return base, role, cut or None


class ResidualHead(nn.Module):
    """The block up to its cut, plus its identity (downsampled when the block downsamples), stacked on channels.

    It holds only the block's submodules it runs (shared with the block), so it moves to its stage's device
    without taking the tail's weights along."""

    def __init__(self, block: nn.Module, cut: str | None = None) -> None:
        super().__init__()
        names = head_tail_names(block, cut)
        assert names is not None
        self.source_names = names[0]  # the block's submodules this part runs (how a device map places it)
        for name in names[0]:
            setattr(self, name, getattr(block, name))
        self.relu = block.relu
        self.has_downsample = "downsample" in names[0]
        self.through_conv2 = "conv2" in names[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        if self.through_conv2:
            out = self.relu(self.bn2(self.conv2(out)))
        identity = self.downsample(x) if self.has_downsample else x
        return torch.cat([out, identity], dim=1)


class ResidualTail(nn.Module):
    """The rest of the block from the head's stacked tensor."""

    def __init__(self, block: nn.Module, cut: str | None = None) -> None:
        super().__init__()
        names = head_tail_names(block, cut)
        assert names is not None
        self.source_names = names[1]
        for name in names[1]:
            setattr(self, name, getattr(block, name))
        self.relu = block.relu
        self.split = getattr(block, names[1][0]).in_channels  # channels of the cut activation

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        out, identity = packed[:, :self.split], packed[:, self.split:]
        if "conv3" in self.source_names and "conv2" in self.source_names:  # a Bottleneck cut after conv1
            out = self.relu(self.bn2(self.conv2(out)))
        if "conv3" in self.source_names:
            out = self.bn3(self.conv3(out))
        else:  # a BasicBlock: conv2 is its last convolution
            out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def split_residual(block: nn.Module, cut: str | None = None) -> tuple[nn.Module, nn.Module] | None:
    """(head, tail) sharing the block's modules, or None where the block cannot be cut there."""
    if head_tail_names(block, cut) is None:
        return None
    return ResidualHead(block, cut), ResidualTail(block, cut)
