"""Disk offload during a load: parameters bound for disk are made, filled and written module by module (host
memory holds one module at most) in accelerate's offload format, and a failed load removes what it wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import CheckpointError
from .checkpoint import TensorEntry
from .initialization import init_module_
from .transfer import CopyJob, copy_into


@contextlib.contextmanager
def undo_offload_on_failure(folder: str | None) -> Iterator[None]:
    """On failure (disk full, interrupt), remove what this load wrote into the offload folder: the folder itself
    if the load created it, else only the files it added, so no half-written offload is left behind."""
    path = Path(folder) if folder is not None else None
    existed = path is not None and path.exists()
    before = set(os.listdir(path)) if existed and path is not None else set()
    try:
        yield
    except BaseException:
        if path is not None and not existed:
            shutil.rmtree(path, ignore_errors=True)
        elif path is not None and path.is_dir():
            for name in set(os.listdir(path)) - before:
                target = path / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
        raise


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(
            value, requires_grad=old.requires_grad if old is not None else True)
    else:
        module._buffers[leaf] = value


@dataclass
class Deferred:
    """A parameter bound for disk: allocated, filled and written only when its module's turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    entry: TensorEntry | None
    init: bool
    aliases: list[str] = field(default_factory=list)


def offload_deferred(model: nn.Module, tensors: list[Deferred], folder: str | None, std: float, seed: int,
             progress: Callable[[int], None] | None) -> float:
    """Module by module: allocate its disk-bound parameters in host memory, fill them (checkpoint or random
    init), write them in accelerate's offload format and drop them, so host memory holds one module at most."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    by_module: dict[str, list[Deferred]] = {}
    for item in tensors:
        by_module.setdefault(item.name.rpartition(".")[0], []).append(item)
    try:
        _offload_modules(model, by_module, folder, std, generator, progress)
    except OSError as exc:  # disk full, folder removed: the caller removes what was written
        raise CheckpointError(
            f"could not write to the offload folder {folder}: {exc.strerror or exc}; free space there or choose "
            "another --offload-folder"
        ) from None
    return time.perf_counter() - start


def _offload_modules(model: nn.Module, by_module: dict[str, list[Deferred]], folder: str | None, std: float,
                     generator: torch.Generator, progress: Callable[[int], None] | None) -> None:
    from accelerate.utils import offload_weight, save_offload_index

    index: dict[str, Any] = {}
    for module_name, items in by_module.items():
        module = model.get_submodule(module_name)
        values = {}
        for item in items:
            empty = torch.empty(item.shape, dtype=item.dtype)
            values[item.name] = nn.Parameter(empty, requires_grad=item.requires_grad)
            set_tensor(model, item.name, values[item.name])
        if any(item.init for item in items):
            init_module_(module, std=std, generator=generator)  # a module's own parameters share one device
        copy_into([CopyJob(item.entry, values[item.name].data) for item in items if item.entry is not None],
                  workers=1, progress=progress)
        for item in items:
            meta = nn.Parameter(torch.empty(item.shape, dtype=item.dtype, device="meta"),
                                requires_grad=item.requires_grad)
            for name in [item.name, *item.aliases]:
                index = offload_weight(values[item.name].data, name, folder, index=index)
                set_tensor(model, name, meta)
        del values
    save_offload_index(index, folder)
