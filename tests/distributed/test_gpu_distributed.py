"""The same equalities with NCCL, one GPU per rank, against devmap's single-process pipeline on the same GPUs.

Tolerances are TF32's: cuDNN runs float32 convolutions in TF32 by default (torch.backends.cudnn.allow_tf32), and
each process may pick other convolution algorithms, so two trained steps differ around 1e-3."""

import pytest

from devmap.testing import require_gpus

from .test_distributed import RESNET, check_run

pytestmark = require_gpus(2)


@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("interleaved", 4)])
def test_two_gpus_equal_the_single_process_pipeline(tmp_path, schedule, stages):
    devices = ["cuda:0", "cuda:1"] * (stages // 2) if schedule == "1f1b" else ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    check_run(tmp_path, [*RESNET, "--schedule", schedule, "--eval-batches", "1"], procs=2, stages=stages,
              devices=devices, tolerance=2e-3)


def test_four_gpus_equal_the_single_process_pipeline(tmp_path):
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    check_run(tmp_path, [*RESNET, "--schedule", "1f1b", "--eval-batches", "1"], procs=4, stages=4,
              devices=[f"cuda:{i}" for i in range(4)], tolerance=2e-3)
