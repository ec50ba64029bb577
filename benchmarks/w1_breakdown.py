"""Where the tutorial's train() spends its time, phase by phase on the host: Single GPU vs devmap's pipeline.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/w1_breakdown.py
Each phase is timed with perf_counter around the harness's own statements (3 batches x 10 calls);
a phase that blocks on the GPU (a pageable copy, a synchronize) shows the GPU work it waited for.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn, optim

from devmap import tutorial_models as tm
from devmap.compare_systems import devmap_systems
from devmap.timing import HarnessConfig

PHASES = ("randn", "labels", "zero_grad", "inputs.to", "forward", "labels.to", "backward", "step", "sync")


def phases(model: nn.Module, devices: list[torch.device], cfg: HarnessConfig, calls: int) -> dict[str, float]:
    spent = dict.fromkeys(PHASES, 0.0)

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        spent[name] += now - since
        return now

    for _ in range(calls + 1):
        if _ == 1:
            spent = dict.fromkeys(PHASES, 0.0)  # the first call warms up
        model.train(True)
        loss_fn, optimizer = nn.MSELoss(), optim.SGD(model.parameters(), lr=cfg.lr)
        idx = torch.LongTensor(cfg.batch_size).random_(0, cfg.num_classes).view(cfg.batch_size, 1)
        for _b in range(cfg.num_batches):
            t = time.perf_counter()
            inputs = torch.randn(cfg.batch_size, 3, cfg.image_w, cfg.image_h)
            t = mark("randn", t)
            labels = torch.zeros(cfg.batch_size, cfg.num_classes).scatter_(1, idx, 1)
            t = mark("labels", t)
            optimizer.zero_grad()
            t = mark("zero_grad", t)
            x = inputs.to(devices[0])
            t = mark("inputs.to", t)
            outputs = model(x)
            t = mark("forward", t)
            labels = labels.to(outputs.device)
            t = mark("labels.to", t)
            loss_fn(outputs, labels).backward()
            t = mark("backward", t)
            optimizer.step()
            t = mark("step", t)
        for d in devices:
            torch.cuda.synchronize(d)
        mark("sync", t)
    return {k: 1000 * v / (calls * cfg.num_batches) for k, v in spent.items()}


def main() -> None:
    cfg = HarnessConfig()
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    systems = {"Single GPU": lambda: tm.single_resnet50(devs[0])}
    systems |= {k: partial(b, devs, cfg) for k, b in devmap_systems(devs, cfg).items()}
    print(f"ms per batch (3 batches x 10 train() calls), torch {torch.__version__}")
    print(f"{'system':<38}" + "".join(f"{p:>10}" for p in PHASES) + f"{'total':>9}")
    for name, build in systems.items():
        row = phases(build(), devs, cfg, calls=10)
        print(f"{name:<38}" + "".join(f"{row[p]:>10.2f}" for p in PHASES) + f"{sum(row.values()):>9.2f}", flush=True)


if __name__ == "__main__":
    main()
