"""GPU-only, two GPUs: `devmap serve --tensor-parallel 2` (NCCL, one process per GPU, CUDA graphs capturing the
all-reduces) gives many requests at once, some joining while others run, the greedy answers of the whole float32 model
on one GPU, both ways of joining."""

import pytest
import torch

from devmap.testing import require_gpus

from .conftest import running_server
from .test_split_serving import SENTENCES, ask_together, whole_model_answers

pytestmark = require_gpus(2)


@pytest.mark.parametrize("joining", ["--no-ride", "--ride"])
def test_a_service_split_over_two_gpus_answers_as_one_gpu(model_root, joining):
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's products in float32, as the service's
    requests = [(SENTENCES[i % len(SENTENCES)] + " " * (i // len(SENTENCES)), 4 + (5 * i) % 13) for i in range(16)]
    with running_server(model_root, "--tensor-parallel", "2", "--max-tokens", "32", joining,
                        max_memory=None) as (url, _):
        answers = ask_together(url, "tiny", requests)
    reference = whole_model_answers(model_root, "tiny", 0)
    assert answers == [reference(p, n) for p, n in requests]
