"""Where a decode step's GPU time goes, kernel by kernel: the step a service runs at one client.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/decode_kernels.py --model tinyllama-1.1b --rows 8
A `devmap.generate` of `--rows` rows (prompt `--prompt`, `--new` new tokens) runs eagerly (graphs off, so that the
profiler sees each kernel) under torch.profiler; its CUDA kernels are summed by name over the decode steps and
divided by the steps: per step, each kernel's time and count, the kernels' total, and the step time of the same call
replayed as CUDA graphs (what serving runs) and compiled, beside the floor of the step: the weights (as stored:
`--quantize int8` counts one byte a weight plus the row scales) and the batch's KV cache (prompt + half the new
tokens) read once at the copy bandwidth measured in the same process. `--join` joins each layer's projections first,
as `devmap serve` does at load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import devmap
from devmap.generation.joined_projections import join_projections
from devmap.loading.quantize import quantized_nbytes
from devmap.planning.runtime_memory import layer_kv_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import copy_bandwidth  # noqa: E402


def step_ms(model, ids, new: int, **kwargs) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds per decode step of a warm call: (call with `new` tokens - call with 1) / (new - 1)."""
    def timed(n: int) -> float:
        devmap.generate(model, ids, max_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        devmap.generate(model, ids, max_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    return (timed(new) - timed(1)) / (new - 1) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--quantize", choices=["int8", "int4", "nf4"], default=None)
    parser.add_argument("--join", action="store_true", help="join each layer's projections (as devmap serve does)")
    args = parser.parse_args()
    model = devmap.load(args.model, device_map={"": 0}, dtype="bfloat16", quantization=args.quantize)
    if args.join:
        print(f"joined {join_projections(model)} projection groups")
    ids = torch.randint(3, model.config.vocab_size, (args.rows, args.prompt))
    weights = quantized_nbytes(model.model) - model.get_input_embeddings().weight.nbytes \
        + quantized_nbytes(model.lm_head)  # a step reads one row of the input embedding
    kv = model.config.num_hidden_layers * layer_kv_bytes(model.config, torch.bfloat16, args.rows,
                                                         args.prompt + args.new // 2)
    bandwidth = copy_bandwidth()
    print(f"{args.model} {args.quantize or 'bf16'}, rows {args.rows}, prompt {args.prompt}: floor "
          f"{(weights + kv) / bandwidth * 1000:.3f} ms per step (weights {weights / 1e9:.2f} GB, KV {kv / 1e9:.2f} GB, "
          f"{bandwidth / 1e12:.2f} TB/s copy)")
    for label, kwargs in (("graphs", {}), ("compiled", {"compile": True}), ("eager", {"graphs": False})):
        print(f"  {label}: {step_ms(model, ids, args.new, **kwargs):.3f} ms per decode step", flush=True)
    devmap.generate(model, ids, max_new_tokens=2, graphs=False)
    with profile(activities=[ProfilerActivity.CUDA]) as one:
        devmap.generate(model, ids, max_new_tokens=1, graphs=False)
    with profile(activities=[ProfilerActivity.CUDA]) as many:
        devmap.generate(model, ids, max_new_tokens=args.new, graphs=False)
    steps = args.new - 1
    totals: dict[str, list[float]] = {}
    for prof, sign in ((many, 1), (one, -1)):
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = totals.setdefault(event.key, [0.0, 0])
                entry[0] += sign * event.device_time_total
                entry[1] += sign * event.count
    rows = sorted(((us / steps, count / steps, name) for name, (us, count) in totals.items()), reverse=True)
    print(f"  eager decode step kernels: {sum(r[0] for r in rows) / 1000:.3f} ms of GPU time in "
          f"{sum(r[1] for r in rows):.0f} kernels per step")
    for us, count, name in rows[:18]:
        print(f"    {us:8.1f} us  {count:5.1f}x  {name[:110]}")


if __name__ == "__main__":
    main()
