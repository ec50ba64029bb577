"""A joining step's host index math (each packed token's row), torch's CPU `repeat_interleave` against numpy's
`repeat`, on an idle host and on a busy one (as a serving host is: the API's process, the benchmark's clients, a
compile's workers).

torch runs `repeat_interleave` on the CPU as a parallel loop over its intra-op threads; when the cores are busy a
call waits for its threads for milliseconds, and the engine core calls it for every step that takes joiners in.
    python3 benchmarks/probes/host_index_math.py --busy 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Callable

import numpy as np
import torch

LENGTHS = [156, 293, 83, 290, 155, 36, 89, 35, 290, 35, 33, 92, 37, 86, 148, 292]  # a wave's prompts, in tokens


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def timed(call: Callable[[], object], calls: int) -> tuple[float, float, float]:
    """p50, p99 and the longest of `calls` calls, in ms."""
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        took.append((time.perf_counter() - started) * 1000)
    took.sort()
    return took[len(took) // 2], took[int(len(took) * 0.99) - 1], took[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=3, help="processes spinning on the cores meanwhile (default 3)")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    rows, lengths = torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)
    rows_np, lengths_np = rows.numpy(), lengths.numpy()
    ways = {"torch repeat_interleave": lambda: rows.repeat_interleave(lengths),
            "numpy repeat": lambda: torch.from_numpy(np.repeat(rows_np, lengths_np))}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, numpy {np.__version__}")
    print("| host | way | p50 ms | p99 ms | longest ms |\n|---|---|---|---|---|")
    for busy in (0, args.busy):
        spinners = [multiprocessing.Process(target=spin, args=(60.0,), daemon=True) for _ in range(busy)]
        for process in spinners:
            process.start()
        time.sleep(0.5 if busy else 0.0)
        for name, call in ways.items():
            p50, p99, longest = timed(call, args.calls)
            print(f"| {busy} busy processes | {name} | {p50:.3f} | {p99:.3f} | {longest:.3f} |")
        for process in spinners:
            process.terminate()


if __name__ == "__main__":
    main()
