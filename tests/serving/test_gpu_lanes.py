"""GPU-only, two and four GPUs: a model served over N GPUs runs its batches in N lanes of `max_batch` rows each (one
per stage), and many requests at once, some joining while others run, get the answers of generating alone (float32);
/metrics shows how busy each stage's GPU was."""

import pytest
import torch

from devmap.serving import EngineLimits, ModelRegistry
from devmap.testing import gpu_count, require_gpus

from .lane_checks import served_and_alone

pytestmark = require_gpus(2)


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_requests_served_over_several_gpus_get_the_answers_of_generating_alone(model_root, riding, gpus, monkeypatch):
    if gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {gpu_count()} visible")
    # the tiny model's tied head runs on the first GPU after the last stage: the check makes a reader that does not
    # wait for it read stale tokens (what a GPU busy with other work once did)
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = EngineLimits(max_batch=4, compile=False, riding=riding)
    budget = {i: "8GiB" for i in range(gpus)}  # the first `gpus` GPUs; the tiny model's 4 layers, one stage each
    registry = ModelRegistry(model_root, "balanced", budget, limits=limits)
    resident = registry.load(model_root / "tiny")
    assert resident.lanes == gpus and resident.max_rows == 4 * gpus
    assert {str(device) for device in resident.model.hf_device_map.values()} == {str(i) for i in range(gpus)}
    metrics: dict = {}
    for served, alone in served_and_alone(registry, limits, "tiny", 6 * gpus, metrics):
        assert served == alone
    assert resident.batch_shape.rows == 4 * gpus
    busy = metrics["engine"].stage_busy  # each stage's GPU, as /metrics shows it
    shares = {labels: gauge._value.get() for labels, gauge in busy._metrics.items()}
    assert {device for _, device in shares} == {f"cuda:{i}" for i in range(gpus)}
    assert all(0 < v <= 1 for v in shares.values())
