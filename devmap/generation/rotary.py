"""Rotary cos/sin on one device, for the steps devmap runs itself (decode steps, packs, lane prefills).

A LLaMA-family model has one rotary module; devmap keeps a copy of its frequencies on every device a stage runs on
(no cross-device read inside a captured step). Where the frequencies are fixed once the module is made (every rope
type but "dynamic" and "longrope", which transformers updates from the positions it meets) the cos/sin are computed
here, as transformers computes them (frequencies × positions in float32, doubled, cos and sin times the module's
attention scaling, cast to the hidden state's dtype): a compiled region that reads them then reads two tensors and a
number, not transformers' forward, whose decorators' closures become guards an entry saved by torch 2.11 cannot load
back (`region_store`). A module with a rope type that updates its frequencies is called as it is.
"""

from __future__ import annotations

import torch
from torch import nn

UPDATING_ROPE_TYPES = ("dynamic", "longrope")  # transformers changes their frequencies as positions grow


class Rotary:
    """The rotary embedding of a model on one device: `rotary(hidden, position_ids)` gives (cos, sin) for those
    positions in hidden's dtype."""

    def __init__(self, module: nn.Module) -> None:
        """`module`: the model's rotary module, or its copy on the device (its frequencies live there)."""
        self.module = module
        rope_type = getattr(self.module, "rope_type", None)
        frequencies = self.module._buffers.get("inv_freq")
        scaling = getattr(self.module, "attention_scaling", None)
        fixed = (isinstance(rope_type, str) and not any(kind in rope_type for kind in UPDATING_ROPE_TYPES)
                 and isinstance(frequencies, torch.Tensor) and isinstance(scaling, (int, float)))
        self.frequencies = frequencies.float() if fixed else None
        self.scaling = float(scaling) if fixed else 1.0

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.frequencies is None:
            return type(self.module).forward(self.module, hidden, position_ids)
        angles = position_ids[..., None].float() * self.frequencies
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scaling).to(hidden.dtype), (angles.sin() * self.scaling).to(hidden.dtype)

