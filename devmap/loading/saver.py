"""Write new checkpoints of presets in the save_pretrained layout, one tensor at a time, atomically."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from .shards import INDEX_FILE, TensorToWrite, plan_shards, plan_tensors, shard_names
from .atomic_dir import check_destination, install, make_temp, umask_now
from .initialization import init_module_
from .tokenizer import SPECIAL, write_tokenizer
from ..planning.memory import Size, dtype_name, parse_dtype, parse_size
from ..planning.models import ModelSource, resolve_source

Progress = Callable[[int, int], None]


@dataclass
class SaveResult:
    """What `save` wrote: file names are relative to `out_dir`; sizes count tensor bytes only."""

    source: str
    out_dir: Path
    files: list[str]
    total_bytes: int
    num_tensors: int
    dtype: str
    sharded: bool
    quantization: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        return data


def save(source: Union[str, Path], out_dir: Union[str, Path], dtype: str | torch.dtype | None = None,
         max_shard_size: Size = "5GB", seed: int = 0, weights: Union[str, Path, None] = None,
         overwrite: bool = False, progress: Progress | None = None, quantization: Any = None,
         device_map: Any = "auto", config_only: bool = False) -> SaveResult:
    """Write a checkpoint of preset `source` into `out_dir`: config.json plus safetensors, sharded above
    `max_shard_size`. Tensors are random (seeded, never the whole model in memory at once) or read from
    the `weights` safetensors file; the directory appears only once everything is written. `config_only` writes the
    configs and tokenizer and no tensors: a directory that `load(..., random_weights=True)` and `devmap serve
    --load-format dummy` read (a 70B model's 138 GB written for random weights only costs minutes and disk).
    With `quantization` ("int8", "int4", "nf4", "fp8" or a BitsAndBytesConfig) the weights are quantized on the devices
    of `device_map` by the same library as `load(..., quantization=...)` and written pre-quantized, in the layout
    transformers' `from_pretrained` reads back (its `quantization_config` in config.json).
    """
    src = _preset(source)
    limit = parse_size(max_shard_size, what="max shard size")
    if limit <= 0:
        raise UsageError(f"invalid max shard size {max_shard_size!r}: it must be above 0, e.g. 5GB or 500MB")
    out = Path(out_dir).expanduser().absolute()
    check_destination(out, overwrite)
    if config_only and (weights is not None or quantization is not None):
        raise UsageError("a config-only directory holds no weights: drop --weights and --quantize")
    if quantization is not None:
        from ..planning.quantization import resolve_quantization

        quantized, target = resolve_quantization(quantization, parse_dtype(dtype), src)
        if quantized is not None:
            return _save_quantized(src, out, target, max_shard_size, limit, seed, weights, progress, quantized,
                                   device_map)
    target = parse_dtype(dtype) or src.default_dtype

    model = src.build("meta")
    if config_only:
        return _save_config_only(src, model, target, out)
    entries, aliases = plan_tensors(model, target)
    shards = plan_shards(entries, limit)
    total = sum(e.nbytes for e in entries)
    names = shard_names(len(shards))
    with contextlib.ExitStack() as stack:
        if weights is not None:
            tensors = _file_tensors(stack, Path(weights).expanduser(), src.name, entries, aliases)
        else:
            std = float(getattr(src.config, "initializer_range", None) or 0.02)
            tensors = _random_tensors(model, entries, std, seed)

        def write(tmp: Path) -> None:
            _write_config(src, model, target, tmp)
            _write_shards(tmp, shards, names, tensors, total, progress)
            if len(shards) > 1:
                weight_map = {e.name: name for shard, name in zip(shards, names) for e in shard}
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

        files = _installed(out, total, write)
    return SaveResult(source=src.name, out_dir=out, files=files, total_bytes=total, num_tensors=len(entries),
                      dtype=dtype_name(target), sharded=len(shards) > 1)


def _save_config_only(src: ModelSource, model: nn.Module, target: torch.dtype, out: Path) -> SaveResult:
    """The configs and tokenizer of `src` into `out`, no tensors."""
    files = _installed(out, 0, lambda tmp: _write_config(src, model, target, tmp))
    return SaveResult(source=src.name, out_dir=out, files=files, total_bytes=0, num_tensors=0,
                      dtype=dtype_name(target), sharded=False)


def _installed(out: Path, total: int, write: Callable[[Path], None]) -> list[str]:
    """`write` into a fresh temporary directory beside `out` (room checked for `total` bytes), installed at `out` once
    complete; nothing is left after a failure. Returns the files written."""
    tmp = make_temp(out, total)
    try:
        write(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        install(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write the checkpoint to {out}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def _save_quantized(src: ModelSource, out: Path, target: torch.dtype, max_shard_size: Size, limit: int, seed: int,
                    weights: Union[str, Path, None], progress: Progress | None, quantization: Any,
                    device_map: Any) -> SaveResult:
    """Write the full-precision checkpoint next to `out`, load it quantized, write that, and install it at `out`."""
    import gc

    from .loader import load
    from .quantized_saver import write_quantized

    plain = make_temp(out, 0)
    tmp = None
    model = None
    try:
        save(src.name, plain, dtype=target, max_shard_size=max_shard_size, seed=seed, weights=weights,
             overwrite=True, progress=progress)
        model = load(plain, device_map, dtype=target, quantization=quantization)
        tmp = make_temp(out, model.devmap_plan.total_bytes)
        names, num_tensors, total = write_quantized(model, tmp, limit)
        for extra in plain.iterdir():  # the tokenizer files
            if extra.is_file() and not (tmp / extra.name).exists() and not extra.name.startswith("model"):
                shutil.copy2(extra, tmp / extra.name)
        files = sorted(p.name for p in tmp.iterdir())
        install(tmp, out)
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write the checkpoint to {out}: {exc.strerror or exc}") from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(plain, ignore_errors=True)
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return SaveResult(source=src.name, out_dir=out, files=files, total_bytes=total, num_tensors=num_tensors,
                      dtype=dtype_name(target), sharded=len(names) > 1, quantization=quantization.scheme)


def _preset(source: Union[str, Path]) -> ModelSource:
    if isinstance(source, nn.Module):
        raise UsageError("save makes new checkpoints from presets: pass a preset name, not a module")
    src = resolve_source(source)
    if src.path is not None or src.kind not in ("torchvision", "llama-preset"):
        raise UsageError(
            f"save makes new checkpoints from presets, and {str(source)!r} is a directory; pass a preset name "
            "(resnet18..resnet152, llama-tiny, tinyllama-1.1b, llama-2-7b, ...) with --weights FILE to reuse tensors"
        )
    return src


@torch.no_grad()
def _random_tensors(model: nn.Module, entries: list[TensorToWrite], std: float, seed: int) -> Iterator[torch.Tensor]:
    """Initialize one module's own tensors at a time on the CPU (init_module_ rules, one seeded generator),
    yield them cast to their output dtype, and send the module back to meta."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    i = 0
    while i < len(entries):
        owner = entries[i].owner
        module = model.get_submodule(owner)
        module.to_empty(device="cpu", recurse=False)
        init_module_(module, std=std, generator=generator)
        own = {**module._parameters, **module._buffers}
        while i < len(entries) and entries[i].owner == owner:
            entry = entries[i]
            yield own[entry.name.rpartition(".")[2]].detach().to(entry.dtype).contiguous()
            i += 1
        del own
        module.to_empty(device="meta", recurse=False)


def _file_tensors(stack: contextlib.ExitStack, path: Path, source: str, entries: list[TensorToWrite],
                  aliases: set[str]) -> Iterator[torch.Tensor]:
    """Check `path` against the planned entries (keys, shapes), then yield its tensors one at a time."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"weights file {path} does not exist; pass a .safetensors file")
    try:
        handle = stack.enter_context(safe_open(str(path), framework="pt"))
        keys = set(handle.keys())
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in keys}
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    expected = {e.name: e.shape for e in entries}
    missing = [k for k in expected if k not in keys]
    unexpected = sorted(keys - set(expected) - aliases)
    wrong = [f"{k} {list(shapes[k])} (expected {list(s)})" for k, s in expected.items() if k in keys and shapes[k] != s]
    problems = [f"{label} {len(items)}: {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                if items]
    if problems:
        raise CheckpointError(f"{path} does not match {source}: " + "; ".join(problems))

    def tensors() -> Iterator[torch.Tensor]:
        for entry in entries:
            yield handle.get_tensor(entry.name).to(entry.dtype).contiguous()

    return tensors()


def _write_config(src: ModelSource, model: nn.Module, target: torch.dtype, tmp: Path) -> None:
    if src.kind == "torchvision":
        config = {"torchvision_model": src.name, "num_classes": int(src.extra.get("num_classes", 1000)),
                  "devmap_format": 1, "dtype": dtype_name(target)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    from transformers import GenerationConfig

    config = copy.deepcopy(src.config)
    config.dtype = dtype_name(target)
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(tmp))
    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    if config.vocab_size >= 259 + len(SPECIAL):  # byte-level BPE needs its 256 bytes and the special ids
        write_tokenizer(tmp, config.vocab_size)


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_shards(tmp: Path, shards: list[list[TensorToWrite]], names: list[str], tensors: Iterator[torch.Tensor],
                  total: int, progress: Progress | None) -> None:
    """Fill each planned shard from `tensors` and write it as soon as it is complete."""
    done = 0
    if progress is not None:
        progress(0, total)
    for shard, name in zip(shards, names):
        buffer: dict[str, torch.Tensor] = {}
        for entry in shard:
            buffer[entry.name] = next(tensors)
            done += entry.nbytes
            if progress is not None:
                progress(done, total)
        _write_shard(buffer, tmp / name)
        del buffer
        os.chmod(tmp / name, 0o666 & ~umask_now())  # safetensors writes 0600; give the usual file permissions
        _trim_heap()


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS: glibc keeps them, and without this RSS creeps up shard by shard."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


