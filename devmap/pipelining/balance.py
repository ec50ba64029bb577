"""Balance pipeline stages by time: profile each block's forward + backward, then split blocks so stages take
equal time.

A split by parameter bytes (accelerate's `balanced`) is a poor pipeline split: ResNet50's layer4 holds
most of the weights but little of the compute. Each block is timed at the micro-batch size on its device,
as a CUDA graph replay where possible (the pipeline replays graphs too), and the contiguous split that
minimizes the slowest stage is chosen, within each device's free memory for the weights.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..errors import PipelineError, UsageError
from .stages import merge_units, split_units

Block = tuple[str, nn.Module]


def _time_cuda(block: nn.Module, x: torch.Tensor, repeat: int) -> float:
    from .graphs import capture_stage

    try:
        run = capture_stage(block, [x], backward=True)[0].replay_step
    except Exception:  # not capturable: time it eagerly
        def run() -> None:
            out = block(x.clone())
            torch.autograd.backward(out, torch.ones_like(out)) if out.requires_grad else None

    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def _time_cpu(block: nn.Module, x: torch.Tensor, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        out = block(x.clone())  # a leaf input cannot go through an in-place ReLU
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return (time.perf_counter() - start) / repeat


def profile_blocks(blocks: list[Block], devices: list[torch.device], sample: torch.Tensor,
                   repeat: int = 10) -> list[float]:
    """Seconds of forward + backward of each block at the batch size of `sample`, each on its device."""
    saved = [b.detach().clone() for _, block in blocks for b in block.buffers()]
    grads = [(p, p.grad) for _, block in blocks for p in block.parameters()]
    times, x = [], sample
    for (_, block), device in zip(blocks, devices):
        with torch.cuda.device(device) if device.type == "cuda" else _nothing():
            x = x.detach().to(device).requires_grad_(x.is_floating_point())
            times.append(_time_cuda(block, x, repeat) if device.type == "cuda" else _time_cpu(block, x, repeat))
            with torch.no_grad():
                x = block(x)
    with torch.no_grad():
        for buffer, value in zip((b for _, block in blocks for b in block.buffers()), saved):
            buffer.copy_(value)
    for param, grad in grads:
        param.grad = grad
    return times


def partition(times: list[float], stages: int, sizes: list[int] | None = None,
              budgets: list[int] | None = None) -> list[int]:
    """Stage index of each block: contiguous, minimizing the slowest stage, each stage within its byte budget."""
    n = len(times)
    if stages > n:
        raise UsageError(f"cannot make {stages} stages out of {n} blocks: ask for at most {n} stages (fewer ranks, "
                         "or --stages / --split-points with fewer cuts)")
    sizes = sizes or [0] * n
    prefix_t, prefix_s = [0.0], [0]
    for t, s in zip(times, sizes):
        prefix_t.append(prefix_t[-1] + t)
        prefix_s.append(prefix_s[-1] + s)
    inf = float("inf")
    # best[s][k]: slowest stage when the first k blocks form s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for k in range(s, n - (stages - s) + 1):
            for j in range(s - 1, k):
                if budgets is not None and prefix_s[k] - prefix_s[j] > budgets[s - 1]:
                    continue
                cost = max(best[s - 1][j], prefix_t[k] - prefix_t[j])
                if cost < best[s][k]:
                    best[s][k], cut[s][k] = cost, j
    if best[stages][n] == inf:
        raise PipelineError("no split into stages fits the devices' memory; "
                            "use fewer blocks per device or more devices")
    owner, k = [0] * n, n
    for s in range(stages, 0, -1):
        j = cut[s][k]
        owner[j:k] = [s - 1] * (k - j)
        k = j
    return owner


def balance_by_time(blocks: list[Block], devices: list[torch.device], sample: torch.Tensor,
                    cut_blocks: bool = True) -> tuple[list[Block], list[torch.device]]:
    """Units (whole blocks, or the head and tail of a residual block cut at a stage boundary) and the device of
    each, so that the stages (one per distinct device, in order) take about equal time."""
    targets = list(dict.fromkeys(devices))
    units = split_units(blocks) if cut_blocks else blocks
    if cut_blocks:
        by_name = {name: device for (name, _), device in zip(blocks, devices)}
        unit_devices = [by_name[name.split("[")[0]] for name, _ in units]
    else:
        unit_devices = list(devices)
    times = profile_blocks(units, unit_devices, sample)
    sizes = [sum(p.numel() * p.element_size() for p in unit.parameters()) for _, unit in units]
    budgets = [int(torch.cuda.mem_get_info(d)[0] * 0.9) + sum(
        s for s, dev in zip(sizes, unit_devices) if dev == d) if d.type == "cuda" else None for d in targets]
    owner = partition(times, len(targets), sizes, None if None in budgets else budgets)  # type: ignore[arg-type]
    return merge_units(units, [targets[s] for s in owner], blocks)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
