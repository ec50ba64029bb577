"""W3 (prefill) and W4 (generation) for a LLaMA-style model on 2 GPUs: one GPU, accelerate's dispatch, devmap.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/llama_inference.py --out $OUT
W3: forward of batch 32 x 512 tokens; W4: greedy generation, batch 32, prompt 64, 32 new tokens (no early
stop). Weights are random (bf16); every system is measured in the same run, best of --repeat.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import devmap
from devmap.generation import forward, generate, timed
from devmap.planning.models import llama_config


CALLS: dict[str, list[float]] = {}  # every call's seconds, first (cold) call included: written to the JSON


def best(fn, repeat: int, label: str = "") -> float:  # type: ignore[no-untyped-def]
    """Best of `repeat` calls after a warm-up call (devmap captures its CUDA graphs in the first two calls)."""
    seconds = [timed(fn)[1] for _ in range(repeat + 1)]
    CALLS[label] = seconds
    return min(seconds[1:])


def profile(fn) -> None:  # type: ignore[no-untyped-def]
    """Kernel time per GPU and the top kernels of one call (after a warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, seconds = timed(fn)
    spans: dict[int, list[tuple[float, float]]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spans.setdefault(event.device_index, []).append((event.time_range.start, event.time_range.end))
    print(f"profiled call: {seconds:.4f} s")
    for device, intervals in sorted(spans.items()):  # union of kernel intervals: how long the GPU was busy
        intervals.sort()
        busy, (start, end) = 0.0, intervals[0]
        first = start
        for a, b in intervals[1:]:
            if a > end:
                busy, start, end = busy + end - start, a, b
            else:
                end = max(end, b)
        busy += end - start
        last = max(b for _, b in intervals)
        print(f"  GPU {device}: busy {busy / 1e3:.2f} ms of its span {(last - first) / 1e3:.2f} ms, "
              f"first kernel at {(first - min(i[0][0] for i in spans.values())) / 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--lanes", default="2,4,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--eager-lanes", default="4", help="lane counts also measured without CUDA graphs")
    parser.add_argument("--device-map", default="balanced", help="devmap's strategy, or a JSON file of a map")
    parser.add_argument("--profile", type=int, default=0, help="profile devmap's prefill at this many lanes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = llama_config(args.model)
    prefill = torch.randint(0, config.vocab_size, (32, 512), device="cuda:0")
    prompt = torch.randint(0, config.vocab_size, (32, 64), device="cuda:0")
    rows: dict[str, dict[str, float]] = {"W3": {}, "W4": {}}

    def systems():  # type: ignore[no-untyped-def]
        with torch.device("cuda:0"):
            one = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        yield "one GPU", one
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        budget = get_balanced_memory(one, dtype=torch.bfloat16, no_split_module_classes=["LlamaDecoderLayer"])
        device_map = infer_auto_device_map(one, budget, no_split_module_classes=["LlamaDecoderLayer"],
                                           dtype=torch.bfloat16)
        yield "accelerate dispatch (balanced)", dispatch_model(one, device_map)
        del one
        gc.collect()
        torch.cuda.empty_cache()
        device_map = args.device_map
        if device_map.endswith(".json"):
            device_map = json.loads(Path(device_map).read_text())
        yield "devmap", devmap.load(args.model, device_map, dtype="bf16")

    for name, model in systems():
        with torch.no_grad():
            if name == "devmap":
                eager = [int(x) for x in args.eager_lanes.split(",") if x]
                for lanes in [int(x) for x in args.lanes.split(",")]:
                    label = f"devmap (lanes {lanes})"
                    rows["W3"][label] = best(lambda: forward(model, prefill, lanes=lanes), args.repeat, "W3 " + label)
                    if lanes == args.profile:  # the CUDA graphs of these lanes are captured by now
                        profile(lambda: forward(model, prefill, lanes=lanes))
                    if args.skip_generate:
                        continue
                    for graphs in (True, False) if lanes in eager else (True,):
                        label = f"devmap (lanes {lanes}{', CUDA graphs' if graphs else ', eager'})"
                        rows["W4"][label] = best(lambda: generate(
                            model, prompt, max_new_tokens=32, lanes=lanes, eos_token_id=[], graphs=graphs),
                            args.repeat, "W4 " + label)
                    devmap.release_graphs(model)
            else:
                rows["W3"][name] = best(lambda: model(prefill), args.repeat)
                if not args.skip_generate:
                    rows["W4"][name] = best(lambda: model.generate(
                        prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0), args.repeat)
        print(f"{name}: {[(w, {k: round(v, 4) for k, v in r.items()}) for w, r in rows.items()]}", flush=True)
    base = "accelerate dispatch (balanced)"
    for workload, unit in (("W3", 32 * 512), ("W4", 32 * 32)):
        if not rows[workload]:
            continue
        print(f"\n{workload} {'prefill 32 x 512' if workload == 'W3' else 'generate 32 x (64 + 32 new)'}, "
              f"{args.model} bf16, torch {torch.__version__}")
        print(f"{'system':<44}{'seconds':>9}{'tokens/s':>11}{'vs accelerate':>15}{'vs one GPU':>12}")
        for name, seconds in rows[workload].items():
            print(f"{name:<44}{seconds:>9.4f}{unit / seconds:>11.0f}{rows[workload][base] / seconds:>14.2f}x"
                  f"{rows[workload]['one GPU'] / seconds:>11.2f}x")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "llama_inference.json").write_text(json.dumps({**rows, "calls": CALLS}, indent=2))
    print("\nevery call (s), warm-up first:", json.dumps({k: [round(x, 4) for x in v] for k, v in CALLS.items()}))


if __name__ == "__main__":
    main()
