"""The data-parallel peer: DistributedDataParallel training ResNet50 (the model fits one GPU), one process per GPU.

Launched by benchmarks/distributed_w2.py as
  torchrun --nproc-per-node N benchmarks/ddp_resnet50.py --batch 256 --steps 10
`--batch` is the global batch (each rank takes batch / N rows); rank 0 prints one JSON line with the seconds
of each training step (forward, MSE on one-hot labels, backward with the all-reduce, SGD).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torchvision.models.resnet50().cuda(), device_ids=[local])
    rows = args.batch // world
    x = torch.randn(rows, 3, args.image, args.image, device="cuda")
    labels = torch.zeros(rows, 1000, device="cuda").scatter_(1, torch.randint(0, 1000, (rows, 1), device="cuda"), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    seconds = []
    for _ in range(args.steps):
        dist.barrier(device_ids=[local])
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), labels).backward()
        optimizer.step()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[local])
        seconds.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps({"system": "ddp", "ranks": world, "batch": args.batch, "step_seconds": seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
