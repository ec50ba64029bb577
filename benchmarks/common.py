"""Helpers the benchmark scripts share: the W2 training step and its timing, W1's host time per statement, and the
probes' GPU time per call (replayed from a CUDA graph) and copy bandwidth.

Scripts run as `PYTHONPATH=. python3 benchmarks/NAME.py`; Python puts benchmarks/ on the path, so each
imports these with `from common import ...`.
"""

from __future__ import annotations

import time

import torch
from torch import nn, optim

from devmap.comparison.timing import HarnessConfig


def training_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
    """One W2 step as a function: zero_grad, forward, MSE on one-hot labels, backward, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    loss_fn = nn.MSELoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss_fn(out, labels.to(out.device)).backward()
        optimizer.step()

    return step


def time_steps(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, steps: int) -> float:
    """Milliseconds per training step, after 3 warm-up steps, all GPUs synchronized."""
    step = training_step(model, x, labels)
    for _ in range(3):
        step()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    return (time.perf_counter() - start) / steps * 1000



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


def cold_process(command: list[str], label: str) -> dict[str, float]:
    """Run `command` as one fresh process: its wall time (`process_s`) and what it reports on its last stdout line
    (a cold-load script's JSON; for `devmap load --json`, its load seconds as `call_s`)."""
    import json
    import subprocess

    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"cold {label} failed: {result.stderr.strip()[-2000:]}")
    row = {"process_s": wall}
    try:
        reported = json.loads(result.stdout)  # the CLI's one JSON object
    except json.JSONDecodeError:
        reported = json.loads(result.stdout.strip().splitlines()[-1])
    row.update({"call_s": reported["load"]["seconds"]} if "load" in reported else reported)
    return row


def graph_timed_us(call, repeat: int = 100) -> float:  # type: ignore[no-untyped-def]
    """GPU microseconds per call of `call`: warmed up (also on a side stream, as a capture needs), captured `repeat`
    times into one CUDA graph, the graph replayed five times."""
    call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 5 / repeat * 1000


def best_seconds(work, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The shortest of `repeats` runs of `work()` on the current stream, each timed with CUDA events."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def matmul_flops() -> float:
    """bf16 floating-point operations per second the GPU's tensor cores sustain: the best of 10 products of two
    8192 × 8192 matrices (the compute floor, measured as `copy_bandwidth` measures the memory's)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    return 2 * 8192 ** 3 / best_seconds(lambda: a @ b, 10)


def copy_bandwidth() -> float:
    """Bytes per second the GPU reads and writes: the best of 20 copies of 2 GiB (each read and written once), each
    timed with events and not captured: a copy captured in a CUDA graph measured 2.44-2.71 TB/s where the same copy
    issued from the host measured ~3.0 (H100) and 4.1-4.3 TB/s (H200), the pace of the kernels a step runs."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / best_seconds(lambda: b.copy_(a), 20)
