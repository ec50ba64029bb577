"""The peer: torch.distributed.pipelining (one process per GPU, NCCL) training ResNet50 at 224x224, GPipe and 1F1B.

Launched by benchmarks/pipeline_resnet50.py as
  torchrun --nproc-per-node 2 benchmarks/tdp_resnet50.py --batch 256 --chunks 4,8 --split layer2.0
Rank 0 prints one JSON line per (schedule, chunks): milliseconds per training step (forward, backward,
SGD) with the same MSE loss on one-hot labels as the other systems.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--chunks", default="4,8")
    parser.add_argument("--split", default="layer2.0", help="last block of stage 0")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from devmap.pipelining.stages import blocks_of

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    blocks = blocks_of(torchvision.models.resnet50())
    cut = [name for name, _ in blocks].index(args.split) + 1
    mine = blocks[:cut] if rank == 0 else blocks[cut:]
    module = nn.Sequential(*[b for _, b in mine]).to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.001)
    x = torch.randn(args.batch, 3, args.image, args.image, device=device)
    labels = torch.zeros(args.batch, 1000, device=device).scatter_(
        1, torch.randint(0, 1000, (args.batch, 1), device=device), 1)
    loss_fn = nn.MSELoss()
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        for chunks in [int(c) for c in args.chunks.split(",")]:
            stage = PipelineStage(module, rank, world, device)
            schedule = schedule_cls(stage, n_microbatches=chunks, loss_fn=loss_fn)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=labels)
                optimizer.step()

            for _ in range(3):
                step()
            torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize(device)
            dist.barrier()
            ms = (time.perf_counter() - start) / args.steps * 1000
            if rank == 0:
                schedule_name = schedule_cls.__name__.removeprefix("Schedule")
                print(json.dumps({"system": f"torch.distributed.pipelining {schedule_name}",
                                  "batch": args.batch, "chunks": chunks, "ms": ms}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
