"""Strategies that turn module sizes and budgets into a device map, on top of accelerate's infer_auto_device_map.

What each strategy means in devmap (and where it differs from accelerate on purpose):

- ``sequential``: fill GPU 0 up to its budget, then GPU 1, ..., then cpu, then disk. accelerate keeps room
  for the largest layer on GPU 0 even when nothing is offloaded, so a model that fits GPU 0 spills onto
  GPU 1; devmap only keeps that room when something is offloaded.
- ``balanced``: split the model over all GPUs so that the fullest GPU holds as little as possible
  (a min-max split in module order). accelerate's heuristic budget plus its GPU-0 reserve leaves GPU 0
  visibly lighter (e.g. 11 of 26 entries of a 1.1B LLaMA on 2 GPUs).
- ``balanced_low_0``: like balanced, but GPU 0 takes half the share of each other GPU, leaving it room
  for generation's working memory. accelerate puts nothing at all on GPU 0 when the rest fits (the whole
  1.1B LLaMA on GPU 1 of 2), which wastes a GPU; on a single GPU it is the same as balanced.
- ``auto``: as in transformers, the same as balanced.

When the model does not fit on the GPUs, every strategy fills the GPUs to their budgets, then cpu, then
disk (accelerate's behaviour, with room kept on GPU 0 and cpu for the largest offloaded layer).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .devices import DeviceKey, is_gpu

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMap = dict[str, DeviceKey]


@contextlib.contextmanager
def accelerate_quietly() -> Iterator[None]:
    """accelerate warns about simulated GPU indices and logs its 90% advice; planning output is ours to give."""
    logger = logging.getLogger("accelerate")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def module_sizes(model: nn.Module, dtype: torch.dtype, special: dict[str, Any] | None = None,
                 extra: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes of every module and tensor name at `dtype`, tensors named in `special` at theirs (quantized weights;
    accelerate's accounting, tied weights counted once), plus `extra` bytes per tensor (their scales)."""
    from accelerate.utils import compute_module_sizes

    sizes = {name: int(round(size)) for name, size in  # half bytes (int4) come back as floats
             compute_module_sizes(model, dtype=dtype, special_dtypes=special or None).items()}
    return with_extra(sizes, extra or {})


def with_extra(sizes: dict[str, int], extra: dict[str, int]) -> dict[str, int]:
    """`sizes` with `extra` bytes per tensor name added to the tensor and every module above it (a new dict)."""
    out = dict(sizes)
    for name, more in extra.items():
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            out[prefix] = out.get(prefix, 0) + more
    return out


def kept_precision(model: nn.Module) -> dict[str, torch.dtype]:
    """{buffer name: its dtype} of the floating buffers a load leaves at their own precision, whatever the model's
    dtype: the non-persistent ones (not in checkpoints; rotary `inv_freq` and `original_inv_freq` stay float32)."""
    kept: dict[str, torch.dtype] = {}
    for module_name, module in model.named_modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_floating_point():
                kept[f"{module_name}.{name}" if module_name else name] = buffer.dtype
    return kept


def usage(device_map: DeviceMap, sizes: dict[str, int]) -> dict[DeviceKey, int]:
    """Bytes each device holds under `device_map`."""
    used: dict[DeviceKey, int] = {}
    for name, device in device_map.items():
        used[device] = used.get(device, 0) + sizes.get(name, 0)
    return used


def _infer(model: nn.Module, caps: dict[DeviceKey, int], no_split: list[str], dtype: torch.dtype,
           special: dict[str, Any] | None = None) -> DeviceMap:
    from accelerate import infer_auto_device_map

    with accelerate_quietly():
        return dict(infer_auto_device_map(model, max_memory=dict(caps), no_split_module_classes=no_split, dtype=dtype,
                                          special_dtypes=special or None))


def _gpu_only(
    model: nn.Module,
    caps: dict[int, int],
    sizes: dict[str, int],
    no_split: list[str],
    dtype: torch.dtype,
    special: dict[str, Any] | None = None,
    seen: float = 1.0,
) -> DeviceMap | None:
    """Place everything on GPUs with at most caps[g] bytes on GPU g, or return None if it doesn't fit.

    accelerate keeps room for the largest layer on its first GPU, for offloaded layers to visit; with
    nothing offloaded that room is wasted. Here its first GPU is a stand-in with no memory (real GPU g
    is passed as g + 1), so the reserve lands there and the real GPUs get exactly their caps.
    accelerate sees `seen` of each byte in `sizes` (it does not count quantization scales), so its caps
    shrink by that share; the result is checked against `sizes` itself.
    """
    shifted = {0: 0, **{g + 1: int(c * seen) for g, c in caps.items()}}
    device_map = _infer(model, shifted, no_split, dtype, special)
    if not all(is_gpu(d) and d > 0 for d in device_map.values()):
        return None
    device_map = {name: d - 1 for name, d in device_map.items()}
    used = usage(device_map, sizes)
    return device_map if all(used.get(g, 0) <= c for g, c in caps.items()) else None


def _min_max_split(
    model: nn.Module,
    limits: dict[DeviceKey, int],
    weights: dict[int, float],
    sizes: dict[str, int],
    no_split: list[str],
    dtype: torch.dtype,
    special: dict[str, Any] | None = None,
    seen: float = 1.0,
) -> DeviceMap | None:
    """Binary-search the smallest per-GPU share C (GPU g capped at weights[g] * C) that holds the whole model."""
    gpus = list(weights)
    total = sizes[""]

    def attempt(share: float) -> DeviceMap | None:
        caps = {g: min(int(weights[g] * share), limits[g]) for g in gpus}
        return _gpu_only(model, caps, sizes, no_split, dtype, special, seen)

    hi = max(limits[g] / weights[g] for g in gpus)
    # Caps of (total + one largest unbreakable block per GPU) always hold a contiguous fill, so the search
    # starts there: a few probes instead of ~19 from a whole GPU's budget (each probe costs seconds at 1000 layers).
    tight = (total + len(gpus) * _largest_unit(model, sizes, no_split)) / sum(weights.values())
    return smallest_share(attempt, total / sum(weights.values()), hi, total, start=tight)


def smallest_share(attempt: Callable[[float], DeviceMap | None], lo: float, hi: float, total: int,
                   start: float | None = None) -> DeviceMap | None:
    """Binary search for the smallest per-GPU share in (lo, hi] whose `attempt` places the model (None when even
    `hi` does not); `start`, when below `hi`, is tried first. Stops within a few hundred KiB: far below a layer."""
    best = attempt(start) if start is not None and start < hi else None
    if best is not None:
        hi = start  # type: ignore[assignment]
    else:
        best = attempt(hi)
    while best is not None and hi - lo > max(total * 0.002, 2**18):
        mid = (lo + hi) / 2
        found = attempt(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    return best


def _largest_unit(model: nn.Module, sizes: dict[str, int], no_split: list[str]) -> int:
    """Bytes of the largest piece placement cannot split: a no-split block or a module without children."""
    units = [sizes.get(name, 0) for name, module in model.named_modules()
             if type(module).__name__ in no_split or next(module.children(), None) is None]
    return max(units, default=0)


def place(
    model: nn.Module,
    strategy: str,
    limits: dict[DeviceKey, int],
    no_split: list[str],
    dtype: torch.dtype,
    special: dict[str, Any] | None = None,
    sizes: dict[str, int] | None = None,
) -> DeviceMap:
    """Device map for `strategy` under byte `limits` (GPUs first, then cpu, then disk); tensors named in
    `special` are sized at their dtype (quantized weights), `sizes` (default: module_sizes) are what the GPUs'
    caps are checked against. Accelerate may put the overflow on "disk" even where `limits` has no disk: the
    caller checks that."""
    if sizes is None:
        sizes, seen = module_sizes(model, dtype, special), 1.0
    else:  # the caller's sizes may count bytes accelerate does not see (quantization scales): only with `special`
        seen = module_sizes(model, dtype, special)[""] / sizes[""] if special and sizes[""] else 1.0
    gpus = [k for k in limits if is_gpu(k) and limits[k] > 0]
    if gpus:
        if strategy == "sequential":
            found = _gpu_only(model, {g: limits[g] for g in gpus}, sizes, no_split, dtype, special, seen)
        else:
            low_0 = strategy == "balanced_low_0" and len(gpus) > 1
            weights = {g: (0.5 if low_0 and g == gpus[0] else 1.0) for g in gpus}
            found = _min_max_split(model, limits, weights, sizes, no_split, dtype, special, seen)
        if found is not None:
            return found
    # accelerate sees `seen` of each byte (not quantization scales, not a workload's runtime bytes): its caps shrink
    # by that share, then by what a device still holds over its limit in `sizes` (their mix differs per device)
    caps = {k: int(v * seen) for k, v in limits.items() if k in gpus or not is_gpu(k)}
    for _ in range(8):
        found = _infer(model, caps, no_split, dtype, special)
        used = usage(found, sizes)
        over = {k: used[k] - limits[k] for k in caps if k != "disk" and used.get(k, 0) > limits[k]}
        if not over:
            break
        for key, excess in over.items():
            caps[key] = max(caps[key] - excess, 0)
    return found
