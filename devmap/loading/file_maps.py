"""Host tensors that are views of their checkpoint file's memory map, as safetensors' and transformers' CPU loads are.

A tensor bound for host memory in the dtype its checkpoint stores it in needs no copy: its bytes are the file's.
`FileMaps` maps each safetensors file once per load (a private mapping: nothing is read until a page is first used,
pages come from the page cache and are shared with every process that maps the same file, and writing to a tensor
copies its page, never the file) and hands out each entry's bytes as a tensor of its dtype and shape, where reading
them into memory of its own was most of a host load's time (docs/cli.md has the measurement).

The file must not be truncated or rewritten in place while a model maps it (its tensors would fault): devmap's own
saves replace a whole directory instead. Headers are checked against the file's size before any tensor is mapped
(`checkpoint.read_safetensors_header`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import TensorEntry


class FileMaps:
    """The memory maps of one load's safetensors files, each made on first use."""

    def __init__(self) -> None:
        self._bytes: dict[Path, torch.Tensor] = {}

    def view(self, entry: TensorEntry) -> torch.Tensor | None:
        """`entry`'s tensor as a view of its file's map, or None where it cannot be one: a pickled tensor, or bytes
        that do not start at a multiple of its element size."""
        if entry.tensor is not None or entry.start % entry.dtype.itemsize:
            return None
        data = self._bytes.get(entry.file)
        if data is None:
            size = entry.file.stat().st_size
            storage = torch.UntypedStorage.from_file(str(entry.file), shared=False, nbytes=size)
            data = self._bytes[entry.file] = torch.empty(0, dtype=torch.uint8).set_(storage)
        return data[entry.start:entry.end].view(entry.dtype).view(entry.shape)
