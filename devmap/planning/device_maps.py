"""What a user may pass as a device map (a strategy, one device for the whole model, a mapping, or a JSON file), and
the checks of an explicit map against the model: names, devices, every tensor placed, tied weights together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Union

import torch
from torch import nn

from ..errors import UsageError
from .budget import Budget
from .devices import DeviceKey, device_label, parse_device_key
from .placement import STRATEGIES, DeviceMap

DeviceMapSpec = Union[str, int, torch.device, Mapping[str, Union[int, str, torch.device]]]
MAX_MAP_FILE_BYTES = 16 * 2**20


def normalize_device_map(spec: DeviceMapSpec) -> str | dict[str, DeviceKey | int | str | torch.device]:
    """A strategy name stays a name; a device (0, "cuda:1", "cpu", torch.device) becomes {"": device}, as in
    transformers; a path ending in .json is read as a {module: device} file; a mapping is returned as given."""
    if isinstance(spec, str) and spec.strip().lower() in STRATEGIES:  # "Balanced" as users type it
        return spec.strip().lower()
    if isinstance(spec, (str, Path)) and str(spec).endswith(".json"):
        return read_device_map_file(Path(spec))
    if isinstance(spec, (str, int, torch.device)) and not isinstance(spec, bool):
        try:
            key = parse_device_key(spec)
        except UsageError:
            raise UsageError(
                f"unknown device map strategy or device {spec!r}: use a strategy ({', '.join(STRATEGIES)}), "
                "one device for the whole model (0, cuda:1, cpu), a {module: device} mapping, "
                "or a .json file holding one"
            ) from None
        if key == "disk":
            raise UsageError("device map 'disk' would put the whole model on disk; give cpu or GPU budgets too")
        return {"": key}
    if isinstance(spec, Mapping) and spec:
        return dict(spec)
    raise UsageError("device_map must be a strategy name, a device, or a non-empty {module name: device} mapping")


def read_device_map_file(path: Path) -> dict[str, int | str]:
    """{module name: device} from a JSON file (as `devmap plan --json` writes under "device_map")."""
    try:
        if path.stat().st_size > MAX_MAP_FILE_BYTES:
            raise UsageError(f"device map file {path} is over {MAX_MAP_FILE_BYTES >> 20} MiB")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"device map file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(f"device map file {path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise UsageError(f"cannot read device map file {path}: {exc.strerror or exc}") from None
    if isinstance(data, dict) and isinstance(data.get("device_map"), dict):
        data = data["device_map"]  # the whole output of `devmap plan --json`
    if not isinstance(data, dict) or not data:
        raise UsageError(f"device map file {path} must hold a non-empty JSON object {{module name: device}}")
    for name, device in data.items():
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise UsageError(f"device map file {path} puts {name!r} on {device!r}: "
                             "use a GPU index, cuda:N, cpu or disk")
    return data


def validate_device_map(
    model: nn.Module, device_map: Mapping[str, Union[int, str, torch.device]], budget: Budget | None = None
) -> DeviceMap:
    """Check an explicit map: known module names, known devices, every parameter and buffer placed, ties together."""
    modules = dict(model.named_modules())
    tensors = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    params = dict(model.named_parameters())
    known_devices = set(budget.limits) if budget is not None and budget.limits else None
    placed: DeviceMap = {}
    for name, device in device_map.items():
        if name not in modules and name not in params:
            close = [m for m in modules if m and m.split(".")[-1] == name.split(".")[-1]][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"device map names {name!r}, which is not a module or parameter of the model{hint}")
        key = parse_device_key(device)
        if known_devices is not None and key not in known_devices and key != "disk":
            raise UsageError(
                f"device map puts {name!r} on {device_label(key)}, which does not exist here "
                f"(devices: {', '.join(device_label(d) for d in known_devices)})"
            )
        placed[name] = key
    placed = in_model_order(model, placed)
    missing = [t for t in tensors if owner_of(t, placed) is None]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UsageError(f"device map leaves {len(missing)} tensors unplaced: {shown}; map their modules to a device")
    _check_ties(model, placed)
    return placed


def in_model_order(model: nn.Module, device_map: DeviceMap) -> DeviceMap:
    """The same map with its entries sorted in the order the model registers its modules and tensors."""
    names = [n for n, _ in model.named_modules()]
    names += [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    order = {n: i for i, n in reversed(list(enumerate(names)))}
    return dict(sorted(device_map.items(), key=lambda item: order.get(item[0], len(order))))


def owner_of(tensor_name: str, placed: DeviceMap) -> str | None:
    """The device-map entry that places `tensor_name` (longest matching prefix)."""
    parts = tensor_name.split(".")
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        if prefix in placed:
            return prefix
    return None


def _check_ties(model: nn.Module, placed: DeviceMap) -> None:
    from accelerate.utils import find_tied_parameters

    for group in find_tied_parameters(model):
        devices = {placed[owner_of(n, placed)] for n in group}
        if len(devices) > 1:
            raise UsageError(
                f"tied parameters {' and '.join(group)} are mapped to different devices "
                f"({', '.join(device_label(d) for d in devices)}); put them on one device"
            )
