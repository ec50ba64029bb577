"""The device key: every form users write parses to one key; labels and torch devices come from keys only."""

import re
from pathlib import Path

import pytest
import torch

from devmap.errors import UsageError
from devmap.planning.devices import device_label, offloaded, parse_device_key, torch_device

PACKAGE = Path(__file__).resolve().parents[2] / "devmap"


@pytest.mark.parametrize("given, key", [(0, 0), ("1", 1), ("cuda:2", 2), ("CUDA:3", 3), ("cuda", 0),
                                        (torch.device("cuda", 1), 1), ("cpu", "cpu"), (" Disk ", "disk"),
                                        (torch.device("cpu"), "cpu")])
def test_every_form_parses_to_one_key(given, key):
    assert parse_device_key(given) == key
    assert parse_device_key(device_label(key)) == key  # a label is only ever made from a key, and names it


@pytest.mark.parametrize("bad", [-1, True, "gpu", "cuda:x", "²", "mps"])
def test_other_devices_are_refused(bad):
    with pytest.raises(UsageError, match="unknown device"):
        parse_device_key(bad)


def test_torch_devices_and_offloading():
    assert torch_device(1) == torch.device("cuda", 1) and torch_device("cpu") == torch.device("cpu")
    assert torch_device("disk", disk_as_cpu=True) == torch.device("cpu")
    with pytest.raises(UsageError, match="nothing runs on disk"):
        torch_device("disk")
    assert offloaded([0, "disk"]) and offloaded([0, 1, "cpu"]) and offloaded(["disk"])
    assert not offloaded([0, 1]) and not offloaded(["cpu"])


def test_no_module_parses_a_device_label_back():
    """Labels ("cuda:0") are for people; only devmap/planning/devices.py turns text into a device key."""
    pattern = re.compile(r'startswith\("cuda:"\)|removeprefix\("cuda:"\)|split\(":"\)\[1\]')
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "devices.py" and pattern.search(p.read_text())]
    assert not offenders, offenders
