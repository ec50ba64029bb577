"""Checkpoints on disk: find the files, read safetensors headers, and check names and shapes before any data is read."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, UsageError
from ..planning.member_paths import member_path

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: a safetensors file and absolute byte offsets (or a pickled tensor)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    tensor: torch.Tensor | None = None  # set for pickle checkpoints, read with weights_only=True

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header; reject truncated or corrupted files before any data is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path} is truncated: shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len <= 0 or header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path} is corrupted or truncated: its header claims {header_len} bytes")
            header = json.loads(f.read(header_len), object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path} is corrupted: its header names {exc.args[0]!r} twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path} is corrupted: its safetensors header is not valid JSON") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupted: its safetensors header is not a JSON object")
    base = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            if not isinstance(info["shape"], list) or not isinstance(info["data_offsets"], list):
                raise TypeError
            shape = tuple(_whole(d) for d in info["shape"])
            begin, end = (_whole(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is corrupted: bad header entry for {name!r}") from None
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected or begin < 0 or min(shape, default=0) < 0:
            raise CheckpointError(f"{path} is corrupted: {name!r} spans {end - begin} bytes, "
                                  f"its shape needs {expected}")
        if base + end > size:
            raise CheckpointError(
                f"{path} is truncated: {name!r} ends at byte {base + end} but the file has {size} bytes; "
                "re-download or re-save the checkpoint"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, base + begin, base + end)
    spans = sorted((e.start, e.end, e.name) for e in entries.values() if e.nbytes)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{path} is corrupted: the bytes of {first!r} and {second!r} overlap")
    return entries


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    data: dict[str, object] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def _whole(value: object) -> int:
    """An integer from JSON (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


def _read_index(index_file: Path) -> dict[str, str]:
    try:
        if index_file.stat().st_size > _MAX_HEADER:
            raise CheckpointError(f"{index_file} is over {_MAX_HEADER >> 20} MiB: not an index transformers writes")
        data = json.loads(index_file.read_text(), object_pairs_hook=_unique_keys)
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise TypeError
        return weight_map
    except _DuplicateKey as exc:
        raise CheckpointError(f"{index_file} names {exc.args[0]!r} twice; re-save the checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
        raise CheckpointError(f"{index_file} is not a valid index: expected JSON with a 'weight_map' object") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {index_file}: {exc.strerror or exc}") from None


def _read_pickle(path: Path, allow_pickle: bool) -> dict[str, TensorEntry]:
    if not allow_pickle:
        raise UsageError(
            f"{path.name} is a pickle checkpoint, which can run code when read; convert it to safetensors, "
            "or pass --allow-pickle (allow_pickle=True) to read it with torch.load(weights_only=True)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a bad pickle
        first_line = str(exc).splitlines()[0]
        raise CheckpointError(f"cannot read {path} with torch.load(weights_only=True): {first_line}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return {
        name: TensorEntry(name, path, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size(), tensor=t)
        for name, t in state.items()
    }


def index_checkpoint(path: Path, allow_pickle: bool = False) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint: a .safetensors file, or a directory with model.safetensors or a sharded index
    (pickle files only with `allow_pickle`)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"checkpoint {path} does not exist; pass a local .safetensors file or model directory")
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            return _read_pickle(path, allow_pickle)
        return read_safetensors_header(path)
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index_file = path / index_name
        if index_file.is_file():
            weight_map = _read_index(index_file)
            shards: dict[str, Path] = {}
            for name in weight_map.values():  # every name is checked before any file is touched
                shards[name] = member_path(path, name, f"{index_name} (weight_map)")
            shards = dict(sorted(shards.items()))
            missing = sorted(f for f, file in shards.items() if not file.is_file())
            if missing:
                raise CheckpointError(
                    f"{index_file.name} names {len(missing)} missing file(s): {', '.join(missing[:3])}; "
                    "copy every shard into the directory"
                )
            entries: dict[str, TensorEntry] = {}
            for shard, file in shards.items():
                shard_entries = index_checkpoint(file, allow_pickle)
                entries.update({n: e for n, e in shard_entries.items() if weight_map.get(n) == shard})
            absent = [n for n, f in weight_map.items() if n not in entries]
            if absent:
                raise CheckpointError(f"{index_file.name} lists {', '.join(absent[:3])} "
                                      "but the shards do not hold them")
            return entries
        if (path / single).is_file():
            return index_checkpoint(path / single, allow_pickle)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        if len(pickles) > 1:
            raise CheckpointError(f"{path} holds several pickle files ({', '.join(pickles[:3])}) and no index")
        return index_checkpoint(path / pickles[0], allow_pickle)
    raise CheckpointError(
        f"{path} holds no weights: expected model.safetensors or model.safetensors.index.json with its shards (for "
        "random weights from its config alone: load(..., random_weights=True), devmap serve --load-format dummy)"
    )


def match_state(
    expected: dict[str, tuple[int, ...]],
    entries: dict[str, TensorEntry],
    tied_groups: list[list[str]],
    allow_missing: bool = False,
    floating: set[str] | None = None,
) -> list[str]:
    """Check checkpoint names and shapes against the model's; return the names the model must initialize itself.

    A tied weight is present when any name of its group is. Unexpected keys are always an error.
    """
    tied_to = {n: group for group in tied_groups for n in group}
    missing = [n for n in expected if n not in entries and not any(t in entries for t in tied_to.get(n, []))]
    unexpected = [n for n in entries if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:4])}; "
            "it was saved from a different model or config"
        )
    mismatched = [
        f"{n} {list(entries[n].shape)} vs model {list(expected[n])}"
        for n in expected
        if n in entries and tuple(entries[n].shape) != tuple(expected[n])
    ]
    if mismatched:
        raise CheckpointError(
            f"{len(mismatched)} tensor shape(s) don't match the config: {'; '.join(mismatched[:3])}"
        )
    if floating is not None:
        kinds = [f"{n} is {entries[n].dtype}" for n in expected
                 if n in entries and entries[n].dtype.is_floating_point != (n in floating)]
        if kinds:
            raise CheckpointError(
                f"{len(kinds)} tensor dtype(s) don't match the model (floating point vs integer): "
                f"{'; '.join(kinds[:3])}; the checkpoint was saved from a different model"
            )
    if missing and not allow_missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensor(s) of the model: {', '.join(missing[:4])}; "
            "pass --allow-missing (allow_missing=True) to initialize them randomly"
        )
    return missing


def file_sizes(entries: dict[str, TensorEntry]) -> int:
    """Total bytes the entries occupy on disk."""
    return sum(e.nbytes for e in entries.values())


def warm_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to read files ahead (no-op where posix_fadvise is missing)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass
