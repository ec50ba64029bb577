"""Sizes, budgets and dtypes."""

import pytest
import torch

from devmap.planning.budget import resolve_budget
from devmap.errors import UsageError
from devmap.planning.memory import parse_dtype, parse_max_memory, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        (1024, 1024),
        ("1024", 1024),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("2MB", 2 * 10**6),
        ("2MiB", 2 * 2**20),
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("1.5TB", int(1.5 * 10**12)),
        ("1TiB", 2**40),
        ("24 gib", 24 * 2**30),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


def test_parse_size_percent_of_total():
    assert parse_size("90%", total=1000) == 900
    assert parse_size("100%", total=1000) == 1000


@pytest.mark.parametrize("bad, words", [
    ("12XB", "unknown unit 'XB'"),
    ("-1GiB", "cannot be negative"),
    ("abc", "expected a number with a unit"),
    ("120%", "at most 100%"),
    ("0%", "above 0%"),
    (-5, "cannot be negative"),
])
def test_parse_size_rejects(bad, words):
    with pytest.raises(UsageError, match=words):
        parse_size(bad, total=1000)


def test_percent_needs_a_known_total():
    with pytest.raises(UsageError, match="needs a device whose total memory is known"):
        parse_size("50%")


def test_parse_max_memory_string_and_dict():
    assert parse_max_memory("0=20GiB, 1=20GiB,cpu=64GiB") == {0: "20GiB", 1: "20GiB", "cpu": "64GiB"}
    assert parse_max_memory({"cuda:1": 5, "disk": "1TB"}) == {1: 5, "disk": "1TB"}
    with pytest.raises(UsageError, match="DEVICE=SIZE"):
        parse_max_memory("20GiB")
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        parse_max_memory("tpu=1GB")


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16
    assert parse_dtype(torch.float32) is torch.float32
    assert parse_dtype(None) is None
    with pytest.raises(UsageError, match="float32, float16, bfloat16"):
        parse_dtype("int8")


def test_simulated_budget_with_cpu_and_percent():
    budget = resolve_budget("0=50%,cpu=8GiB", gpus=2, gpu_memory="80GiB")
    assert budget.simulated
    assert budget.limits == {0: 40 * 2**30, 1: 80 * 2**30, "cpu": 8 * 2**30}
    assert list(budget.limits) == [0, 1, "cpu"]


def test_budget_argument_errors():
    with pytest.raises(UsageError, match="needs --gpus"):
        resolve_budget(gpu_memory="80GiB")
    with pytest.raises(UsageError, match="at least 1"):
        resolve_budget(gpus=0, gpu_memory="1GB")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="add --gpu-memory"):
            resolve_budget(gpus=2)


def test_default_budget_without_gpus_is_host_memory():
    if torch.cuda.is_available():
        pytest.skip("machine has GPUs")
    budget = resolve_budget()
    assert list(budget.limits) == ["cpu"] and budget.limits["cpu"] > 0
    assert "disk" in resolve_budget(offload_folder="/tmp/devmap-offload-test").limits
