"""Load only a rank's own stage tensors from a safetensors checkpoint: no rank ever holds the whole model.

The model is built on the meta device; the tensors of the rank's stage modules are read by name (the
model's state_dict names, which the stage modules share) with safetensors' `safe_open`, straight onto the
rank's device. Everything else stays on meta.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..errors import CheckpointError


def load_stage_weights(model: nn.Module, modules: Sequence[nn.Module], checkpoint: str | Path,
                       device: torch.device | str) -> int:
    """Fill the parameters and buffers of `modules` (parts of `model`) from `checkpoint`; returns bytes read."""
    from safetensors import safe_open

    from ..loading.checkpoint import index_checkpoint

    entries = index_checkpoint(Path(checkpoint).expanduser())
    owned = {id(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
    slots = [(module, kind, attr, f"{name}.{attr}" if name else attr)
             for name, module in model.named_modules()
             for kind in ("_parameters", "_buffers")
             for attr, tensor in getattr(module, kind).items()
             if tensor is not None and id(tensor) in owned]
    missing = [full for _, kind, attr, full in slots
               if full not in entries and not (kind == "_buffers" and attr in _non_persistent(model, full))]
    if missing:
        raise CheckpointError(f"{checkpoint} lacks {len(missing)} tensors of this rank's stages, e.g. "
                              f"{', '.join(missing[:3])}; save the checkpoint from the same model")
    by_file: dict[Path, list[tuple[nn.Module, str, str, str]]] = {}
    for slot in slots:
        if slot[3] in entries:
            by_file.setdefault(entries[slot[3]].file, []).append(slot)
    read = 0
    target = torch.device(device)
    for file, file_slots in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for module, kind, attr, full in file_slots:
                old = getattr(module, kind)[attr]
                value = handle.get_tensor(full)
                if tuple(value.shape) != tuple(old.shape):
                    raise CheckpointError(f"{full} is {tuple(value.shape)} in {file.name}, the model has "
                                          f"{tuple(old.shape)}")
                value = value.to(target, dtype=old.dtype if old.is_floating_point() else value.dtype)
                read += value.numel() * value.element_size()
                getattr(module, kind)[attr] = (nn.Parameter(value, requires_grad=old.requires_grad)
                                               if kind == "_parameters" else value)
    for module in modules:  # non-persistent buffers (not in checkpoints) are made where the stage runs
        for sub in module.modules():
            for attr, buffer in sub._buffers.items():
                if buffer is not None and buffer.device.type == "meta":
                    raise CheckpointError(f"buffer {attr} of {type(sub).__name__} is not in {checkpoint} and "
                                          "cannot be rebuilt here; save it in the checkpoint")
    return read


def _non_persistent(model: nn.Module, full: str) -> set[str]:
    owner = model.get_submodule(full.rpartition(".")[0]) if "." in full else model
    return set(getattr(owner, "_non_persistent_buffers_set", set()))
