"""Where a devmap generate call's time goes: host issue time against the whole call, per lane count.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/decode_probe.py --lanes 2,3,4 [--compile]
The call returns after a GPU sync; `issue` is the time until the host has issued every lane-step (the
LaneRunner never waits for a GPU on the way), so issue close to the whole call means the host is the bound.
"""

from __future__ import annotations

import argparse
import time

import torch

import devmap
from devmap.generation import generate, lane_runner, timed
from devmap.planning.models import llama_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--lanes", default="2,3,4")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    config = llama_config(args.model)
    prompt = torch.randint(0, config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    model = devmap.load(args.model, "balanced", dtype="bf16")
    issued: list[float] = []
    original = lane_runner.LaneRunner.generate

    def timed_generate(self, *a, **k):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        original(self, *a, **k)
        issued.append(time.perf_counter() - start)

    lane_runner.LaneRunner.generate = timed_generate
    for lanes in [int(x) for x in args.lanes.split(",")]:
        call = lambda: generate(model, prompt, max_new_tokens=args.new, lanes=lanes, eos_token_id=[],  # noqa: E731
                                compile=args.compile)
        seconds = [timed(call)[1] for _ in range(4)]
        print(f"lanes {lanes}: calls {[round(s, 4) for s in seconds]}, issue loop of the last "
              f"{issued[-1] * 1e3:.1f} ms ({issued[-1] / seconds[-1]:.0%} of the call)", flush=True)
        devmap.release_graphs(model)


if __name__ == "__main__":
    main()
