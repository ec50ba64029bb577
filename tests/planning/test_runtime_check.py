"""Runs that will not fit are refused before anything is allocated, with the numbers: devmap.pipeline given a
workload, and devmap.generate's KV caches, against what each GPU has free (the GPU simulated here)."""

from types import SimpleNamespace

import pytest
import torch
import torchvision

from devmap.errors import DoesNotFitError
from devmap.generation.kv_room import check_kv_room
from devmap.planning.models import resolve_source
from devmap.planning.runtime_check import check_runtime_room
from devmap.planning.workload import parse_workload

GIB = 1 << 30


@pytest.fixture
def gpu_with_free(monkeypatch):
    """A GPU 0 whose free memory the test sets."""
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: GIB // 2)  # half a GiB cached, unused
    return free


def test_a_training_run_that_will_not_fit_is_refused_with_numbers(gpu_with_free):
    model = torchvision.models.resnet50()
    model.hf_device_map = {"": 0}
    workload = parse_workload("train", causal_lm=False, batch=256, input_shape=(3, 224, 224), chunks=4)
    gpu_with_free["bytes"] = 30 * GIB
    check_runtime_room(model, workload, "devmap.pipeline")  # about 21 GiB of activations: fits
    gpu_with_free["bytes"] = 10 * GIB
    with pytest.raises(DoesNotFitError, match=r"devmap.pipeline for train 256 × 3×224×224 in 4 micro-batches needs "
                                              r"2\d\.\d\d GiB on cuda:0 with 10.50 GiB free"):
        check_runtime_room(model, workload, "devmap.pipeline")


def test_generation_whose_kv_caches_will_not_fit_is_refused_before_they_are_allocated(gpu_with_free):
    config = resolve_source("llama-2-7b").config
    layers = [object()] * 16
    stages = SimpleNamespace(config=config, dtype=torch.bfloat16, stages=[
        SimpleNamespace(device=torch.device("cuda", 0), layers=layers),
        SimpleNamespace(device=torch.device("cpu"), layers=layers)])  # a CPU stage's caches are not checked here
    gpu_with_free["bytes"] = 20 * GIB
    check_kv_room(stages, 32, 2048, "devmap.generate")  # 16 layers × 32 × 2048 tokens: 16 GiB
    with pytest.raises(DoesNotFitError, match=r"devmap.generate of 64 rows × 2048 tokens needs 32.00 GiB of KV "
                                              r"cache on cuda:0 with 20.50 GiB free"):
        check_kv_room(stages, 64, 2048, "devmap.generate")
