"""What a new batch shape costs a compiled service: compiled decode steps with fixed shapes against dynamic ones.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/compile_shapes.py --model tinyllama-1.1b --dynamic off
Continuous batches of growing shapes (rows : first slot : cache length), as a service meets them, each run twice:
the first batch of a shape pays compiling (unless compiled code for it exists) and capturing; the second replays.
Prints per shape the seconds of the first batch's first step, the graphs dynamo compiled for it, and the
milliseconds per decode step once warm.
"""

from __future__ import annotations

import argparse
import time

import torch

import devmap
from devmap.generation import lanes
from devmap.generation.continuous import SlotRequest, continuous_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--dynamic", choices=["devmap", "off"], default="devmap",
                        help="devmap: as devmap compiles a continuous batch's steps (dynamic sizes); off: fixed "
                             "shapes")
    parser.add_argument("--shapes", default="8:256:384,16:256:384,16:384:512,32:384:512,64:512:640,64:512:768")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    if args.dynamic == "off":
        compiled = lanes.LaneStreams.compiled_body

        def fixed_shapes(runner: lanes.LaneStreams, body):  # regions compiled for each shape
            runner.dynamic = False
            return compiled(runner, body)

        lanes.LaneStreams.compiled_body = fixed_shapes
    from torch._dynamo.utils import counters

    model = devmap.load(args.model, device_map={"": 0}, dtype="bfloat16")
    vocab = model.config.vocab_size
    print(f"{args.model}, dynamic={args.dynamic}, torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        rows, slot, cache = (int(v) for v in shape.split(":"))
        firsts, per_step = [], 0.0
        for attempt in range(2):
            graphs_before = counters["stats"]["unique_graphs"]
            requests = [SlotRequest(torch.randint(3, vocab, (slot // 2,)).tolist(), cache - slot, i)
                        for i in range(rows)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            with continuous_batch(model, rows=rows, first_slot=slot, cache_len=cache, compile=True) as batch:
                batch.step(requests)
                batch.collect(everything=True)
                torch.cuda.synchronize()
                firsts.append(time.perf_counter() - start)
                compiled = counters["stats"]["unique_graphs"] - graphs_before
                batch.step([])
                batch.collect(everything=True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    batch.step([])
                batch.collect(everything=True)
                torch.cuda.synchronize()
                per_step = (time.perf_counter() - start) / args.steps * 1000
            if attempt == 0:
                first_compiled = compiled
        print(f"  rows {rows:3d} slot {slot:4d} cache {cache:4d}: first step {firsts[0]:7.2f} s "
              f"({first_compiled} graphs compiled), again {firsts[1]:5.2f} s; warm {per_step:.3f} ms per step",
              flush=True)


if __name__ == "__main__":
    main()
