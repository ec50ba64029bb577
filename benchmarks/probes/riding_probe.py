"""Decode steps that carry joiners' prompts: what their compile and captures cost, what a step costs by the prompt
tokens it carries, and a closed loop's pace at several step budgets, beside the weight-read floor.

Run on a GPU machine:  PYTHONPATH=. python3 benchmarks/probes/riding_probe.py --model llama-2-13b
[--quantize int8|int4|nf4]
Loads the model (random bf16 weights, or int8, int4 or nf4 ones: nf4 needs bitsandbytes), joins its projections as
`devmap serve` does, times the service's warm-up (the compiles) and the opening of a batch of `--clients` rows (its
captures), then the GPU time of one step of every row alone and carrying a pack of several widths, then closed loops
of `--clients` clients (`join_probe`'s) with compiled steps at each of `--budgets` prompt tokens per step, each after
a loop of 3 s that compiles and captures its shapes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import devmap
from devmap.generation import mixed_joins
from devmap.generation.continuous import SlotRequest, continuous_batch
from devmap.generation.joined_projections import join_projections
from devmap.loading.quantize import quantized_nbytes
from devmap.serving.warm_up import warm_up

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth  # noqa: E402
from probes.join_probe import closed_loop, loop_arguments  # noqa: E402


def timed(call) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profiled(model: torch.nn.Module, rows: int, first_slot: int, cache_len: int, width: int) -> None:
    """The top kernels of three eager steps of `rows` rows alone, then of three carrying `width` - 1 prompt tokens."""
    from torch.profiler import ProfilerActivity, profile

    with continuous_batch(model, rows=rows, first_slot=first_slot, cache_len=cache_len, graphs=False,
                          riding=True) as batch:
        owners = [SlotRequest([5] * 100, batch.most_new_tokens, i) for i in range(rows)]
        batch.step(owners)
        while batch.joins.waiting():
            batch.step()
        for carrying in (False, True):
            for _ in range(2):
                batch.step()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for n in range(3):
                    if carrying:
                        batch.release(owners[n].owner)
                        owners[n] = SlotRequest([7] * (width - 1), batch.most_new_tokens, (width, n))
                    batch.step([owners[n]] if carrying else [])
                torch.cuda.synchronize()
            label = f"carrying {width - 1} prompt tokens" if carrying else "alone"
            print(f"three steps of {rows} rows {label}:")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
        batch.collect(everything=True)


def host_profiled(model: torch.nn.Module, clients: int, lengths: list[int], new: int, seconds: float, rows: int,
                  first_slot: int, cache_len: int) -> None:
    """Closed loops with joiners riding the steps and joining through prefills of their own (compiled both; each
    compiled and captured in a short loop first), then the host's busiest calls over half a second of a riding loop."""
    from torch.profiler import ProfilerActivity, profile

    def loop(riding: bool, length: float) -> dict[str, float]:
        return closed_loop(model, clients, lengths, new, length, rows, first_slot, cache_len, compile=True,
                           riding=riding)

    for riding in (True, False):
        loop(riding, 2.0)  # compiles, captures
    for riding in (True, False):
        result = loop(riding, seconds)
        step = result["wall_s"] / max(result["steps"], 1)
        print(f"closed loop, joiners {'riding' if riding else 'apart'}:", {k: round(v, 4) for k, v in result.items()},
              f"{step * 1e3:.2f} ms per step", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = loop(True, 0.5)
    print(f"profiled riding loop: {result['steps']} steps, {result['wall_s']:.2f} s", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    parser = loop_arguments(__doc__)
    parser.add_argument("--budgets", default="512,256,1024",
                        help="prompt tokens a step carries at most, a closed loop each (empty: no loops)")
    parser.add_argument("--widths", default="64,128,256,384")
    parser.add_argument("--quantize", default=None, choices=["int8", "int4", "nf4"],
                        help="quantized weights (`devmap serve --quantize`)")
    parser.add_argument("--profile", action="store_true",
                        help="only: the kernels of eager steps, alone and carrying a pack of the second width")
    parser.add_argument("--host", action="store_true",
                        help="only: closed loops of compiled steps with joiners riding and joining apart, then the "
                             "host's busiest calls over a riding loop (CUDA runtime calls and torch ops)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    model = devmap.load(args.model, "balanced", dtype="bf16", quantization=args.quantize)
    print(f"joined {join_projections(model)} projection groups", flush=True)
    weights = quantized_nbytes(model) + sum(b.nbytes for b in model.buffers())  # int4's layers keep theirs as buffers
    print(f"HBM {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB: floor {weights / bandwidth * 1e3:.2f} ms "
          "per step (weights only)", flush=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, first_slot = args.clients, -(-(max(lengths) + args.new - 1) // 32) * 32
    cache_len = -(-(first_slot + args.new) // 128) * 128
    if args.profile:
        profiled(model, rows, first_slot, cache_len, int(args.widths.split(",")[1]))
        return
    if args.host:
        host_profiled(model, args.clients, lengths, args.new, args.seconds, rows, first_slot, cache_len)
        return
    print(f"warm-up (compiles): {timed(lambda: warm_up(model, args.clients, 4096, riding=True)):.1f} s", flush=True)
    start = time.perf_counter()
    with continuous_batch(model, rows=rows, first_slot=first_slot, cache_len=cache_len, compile=True,
                          riding=True) as batch:
        print(f"batch of {rows} rows opened (captures): {time.perf_counter() - start:.1f} s", flush=True)
        owners = [SlotRequest([5] * 100, batch.most_new_tokens, i) for i in range(rows)]
        batch.step(owners)
        while batch.joins.waiting():
            batch.step()
        for _ in range(4):
            batch.step()
        alone = [timed(batch.step) for _ in range(10)]
        print(f"step of {rows} rows: {min(alone) * 1e3:.2f} ms (min of 10)", flush=True)
        for width in [int(w) for w in args.widths.split(",")]:
            times = []
            for n in range(6):
                batch.release(owners[n].owner)
                batch.step()  # the row frees once its issued tokens are counted
                owners[n] = SlotRequest([7] * (width - 1), batch.most_new_tokens, (width, n))
                times.append(timed(lambda: batch.step([owners[n]])))
            print(f"step of {rows} rows carrying {width - 1} prompt tokens: {min(times[1:]) * 1e3:.2f} ms "
                  f"(first {times[0] * 1e3:.1f} ms)", flush=True)
        batch.collect(everything=True)
    devmap.release_graphs(model)
    for budget in [int(b) for b in args.budgets.split(",") if b]:
        mixed_joins.RIDING_TOKENS = budget
        closed_loop(model, args.clients, lengths, args.new, 3.0, rows, first_slot, cache_len, compile=True,
                    riding=True)  # compiles and captures this budget's shapes: the loop below is steady
        result = closed_loop(model, args.clients, lengths, args.new, args.seconds, rows, first_slot, cache_len,
                             compile=True, riding=True)
        step = result["wall_s"] / max(result["steps"], 1)
        print(f"closed loop, {budget} prompt tokens per step:", {k: round(v, 4) for k, v in result.items()},
              f"{step * 1e3:.2f} ms per step", flush=True)
        devmap.release_graphs(model)


if __name__ == "__main__":
    main()
