"""Sizes and dtypes: parse "24GiB" / "80GB" / "90%" and max_memory specs, format byte counts, and name dtypes."""

from __future__ import annotations

import re
from typing import Mapping, Union

import torch

from ..errors import UsageError
from .devices import DeviceKey, parse_device_key

Size = Union[int, str]

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_UNIT_HELP = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or a percentage such as 90%"
_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)$")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DTYPE_CHOICES = ("float32", "float16", "bfloat16")


def parse_size(value: Size | float, *, total: int | None = None, what: str = "size") -> int:
    """Return a byte count for an int, "24GiB", "80GB", "1.5TB" or "90%" (of `total`)."""
    if isinstance(value, bool):
        raise UsageError(f"invalid {what} {value!r}: expected a byte count or a size such as 24GiB")
    if isinstance(value, (int, float)):
        if value < 0:
            raise UsageError(f"invalid {what} {value!r}: a size cannot be negative")
        return int(value)
    text = str(value).strip()
    if text.startswith("-"):
        raise UsageError(f"invalid {what} {value!r}: a size cannot be negative")
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise UsageError(f"invalid {what} {value!r}: expected a percentage such as 90%") from None
        if not 0 < percent <= 100:
            raise UsageError(f"invalid {what} {value!r}: a percentage must be above 0% and at most 100%")
        if total is None:
            raise UsageError(
                f"invalid {what} {value!r}: a percentage needs a device whose total memory is known; "
                "give an absolute size such as 20GiB"
            )
        return int(total * percent / 100)
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"invalid {what} {value!r}: expected a number with a unit ({_UNIT_HELP})")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    if unit not in _UNITS:
        raise UsageError(f"invalid {what} {value!r}: unknown unit {match.group(2)!r} (use {_UNIT_HELP})")
    return int(number * _UNITS[unit])


def parse_max_memory(spec: str | Mapping[DeviceKey, Size] | None) -> dict[DeviceKey, Size]:
    """Read "0=20GiB,1=20GiB,cpu=64GiB" or a dict into {device key: raw size} (sizes are parsed later)."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        items: dict[DeviceKey, Size] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise UsageError(
                    f"invalid --max-memory entry {part!r}: expected DEVICE=SIZE, e.g. 0=20GiB,1=20GiB,cpu=64GiB"
                )
            key, _, size = part.partition("=")
            items[parse_device_key(key)] = size.strip()
        if not items:
            raise UsageError("empty --max-memory: expected DEVICE=SIZE pairs, e.g. 0=20GiB,cpu=64GiB")
        return items
    return {parse_device_key(k): v for k, v in spec.items()}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map "bf16", "float16", torch.float32, ... to a torch dtype; None and "auto" (the checkpoint's own dtype, as
    in transformers) give None."""
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        return None
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in _DTYPES.values():
            raise UsageError(f"unsupported dtype {dtype}: use one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise UsageError(
            f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)} (or fp32, fp16, bf16, auto)"
        )
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """Return "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def format_bytes(num: float) -> str:
    """Human-readable binary size: 1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"


def format_count(num: int) -> str:
    """Human-readable parameter count: 6738415616 -> "6.74B"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num >= scale:
            return f"{num / scale:.2f}{unit}"
    return str(num)


