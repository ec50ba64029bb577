"""W3 and W4 with several pipeline stages on one GPU (`split_layers`): what the stream rules cost, same run.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/stages_one_gpu.py --model tinyllama-1.1b
W3: forward of batch 32 x 512 tokens (lanes 8); W4: greedy, batch 32, prompt 64, 32 new tokens (lanes 3 over the
stages, more lanes than stages: the hand-offs of every lane-step cross streams). Random bf16 weights, CUDA graphs.
Steady state = best of --repeat calls after the first; the first call (eager run, capture) beside it. One JSON line
per row, then a table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from devmap.generation import forward, generate
from devmap.planning.models import llama_config


def measure(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[0], min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--label", default="devmap")
    args = parser.parse_args()
    config = llama_config(args.model)
    g = torch.Generator().manual_seed(0)
    prefill = torch.randint(0, config.vocab_size, (32, 512), generator=g).to("cuda:0")
    prompt = torch.randint(0, config.vocab_size, (32, 64), generator=g).to("cuda:0")
    with torch.device("cuda:0"), torch.no_grad():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    layers = config.num_hidden_layers
    rows = []
    for stages in [int(s) for s in args.stages.split(",")]:
        split = [round(i * layers / stages) for i in range(1, stages)]
        w3 = measure(lambda: forward(model, prefill, lanes=8, split_layers=split), args.repeat)
        w4 = measure(lambda: generate(model, prompt, max_new_tokens=32, lanes=3, split_layers=split,
                                      eos_token_id=[]), args.repeat)
        row = {"label": args.label, "model": args.model, "stages": stages, "w3_first_s": w3[0], "w3_s": w3[1],
               "w4_first_s": w4[0], "w4_s": w4[1], "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'system':<24} {'stages':>6} {'W3 ms':>8} {'(first)':>8} {'W4 ms':>8} {'(first)':>8}")
    for r in rows:
        print(f"{r['label']:<24} {r['stages']:>6} {1e3 * r['w3_s']:>8.1f} {1e3 * r['w3_first_s']:>8.0f} "
              f"{1e3 * r['w4_s']:>8.1f} {1e3 * r['w4_first_s']:>8.0f}")


if __name__ == "__main__":
    main()
