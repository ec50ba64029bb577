"""What a user may pass as a device map: a strategy, one device for the whole model, a mapping, or a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Union

import torch

from ..errors import UsageError
from .devices import DeviceKey, parse_device_key
from .placement import STRATEGIES

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
                f"unknown device map strategy or device {spec!r}: use a strategy ({', '.join(STRATEGIES)}), one device for the whole "
                "model (0, cuda:1, cpu), a {module: device} mapping, or a .json file holding one"
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
            raise UsageError(f"device map file {path} puts {name!r} on {device!r}: use a GPU index, cuda:N, cpu or disk")
    return data
