"""GPU-only, two GPUs: a model served over two GPUs runs its batches in two lanes of `max_batch` rows each (one per
stage), and many requests at once, some joining while others run, get the answers of generating alone (float32);
/metrics shows how busy each stage's GPU was."""

import pytest
import torch

from devmap.serving import EngineLimits, ModelRegistry
from devmap.testing import require_gpus

from .lane_checks import served_and_alone

pytestmark = require_gpus(2)


@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_requests_served_over_two_gpus_get_the_answers_of_generating_alone(model_root, riding):
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4, compile=False, riding=riding)
    registry = ModelRegistry(model_root, "balanced", limits=limits)
    resident = registry.load(model_root / "tiny")
    assert resident.lanes == 2 and resident.max_rows == 8
    assert {str(device) for device in resident.model.hf_device_map.values()} >= {"0", "1"}
    metrics: dict = {}
    for served, alone in served_and_alone(registry, limits, "tiny", 12, metrics):
        assert served == alone
    assert resident.batch_shape.rows == 8
    busy = metrics["engine"].stage_busy  # each stage's GPU, as /metrics shows it
    shares = {labels: gauge._value.get() for labels, gauge in busy._metrics.items()}
    assert {device for _, device in shares} == {"cuda:0", "cuda:1"} and all(0 < v <= 1 for v in shares.values())
