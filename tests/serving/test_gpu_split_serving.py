"""GPU-only, two and four GPUs: `devmap serve --tensor-parallel 2` (NCCL, two processes, CUDA graphs capturing the
all-reduces; on four GPUs two pipeline stages of two) gives many requests at once, some joining while others run, the
greedy answers of the whole float32 model on one GPU, both ways of joining."""

import httpx
import pytest
import torch

from devmap.testing import gpu_count, require_gpus

from .conftest import running_server
from .test_split_serving import SENTENCES, ask_together, whole_model_answers

pytestmark = require_gpus(2)


@pytest.mark.parametrize("joining, gpus", [("--no-ride", 2), ("--ride", 2), ("--no-ride", 4), ("--ride", 4)])
def test_a_service_split_over_two_gpus_answers_as_one_gpu(model_root, joining, gpus):
    if gpu_count() < gpus:  # on four: two pipeline stages of two GPUs, each process holding its GPU of both
        pytest.skip(f"needs {gpus} CUDA GPUs, {gpu_count()} visible")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's products in float32, as the service's
    requests = [(SENTENCES[i % len(SENTENCES)] + " " * (i // len(SENTENCES)), 4 + (5 * i) % 13) for i in range(16)]
    visible = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    with running_server(model_root, "--tensor-parallel", "2", "--max-tokens", "32", joining,
                        max_memory=None, env=visible) as (url, _):
        loaded = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        answers = ask_together(url, "tiny", requests)
    assert len({device for device in loaded["device_map"].values()}) == gpus // 2  # rank 0's GPU of each stage
    reference = whole_model_answers(model_root, "tiny", 0)
    assert answers == [reference(p, n) for p, n in requests]
