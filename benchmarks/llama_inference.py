"""W3 (prefill) and W4 (generation) for a LLaMA-style model on 2 GPUs: devmap against the strongest peers, one run.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/llama_inference.py --model tinyllama-1.1b --out $OUT
Systems (`--systems`, in this order; every one measured in the same process run, TP in a torchrun child):
  eager        transformers, one GPU, eager forward / generate with its dynamic cache
  compiled     transformers, one GPU, `torch.compile(model)` forward / generate(cache_implementation="static")
               (its auto-compiled decode step): the fastest one-GPU path
  tp           transformers `tp_plan="auto"` over --tp-size GPUs under torchrun, static cache (benchmarks/llama_tp.py)
  devmap-tp    devmap's tensor parallelism over --tp-size GPUs under torchrun (`devmap.load(tensor_parallel=N)`), its
               CUDA graphs capturing the collectives; devmap-tp-compiled: its steps through torch.compile too
               (both TP rows see the first --tp-size GPUs only: tensor parallelism alone, no pipeline stages)
  accelerate   accelerate's dispatch_model, balanced over 2 GPUs (its own map, from the one-GPU model)
  hooks        accelerate's dispatch on devmap's loaded model (its AlignDevicesHooks; for shapes that fit no GPU)
  devmap       devmap's pipeline, CUDA graphs of the eager layer code (compile=False)
  devmap-compiled  devmap's pipeline, torch.compile'd stage steps inside its CUDA graphs (compile=True)
W3: forward of batch 32 x 512 tokens; W4: greedy, batch 32, prompt 64, 32 new tokens (no early stop). Random
bf16 weights. Steady state = best of --repeat calls after the first; the first call (compilation, capture)
is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM

import devmap
from devmap.generation import forward, generate, timed
from devmap.planning.models import llama_config

CALLS: dict[str, list[float]] = {}  # every call's seconds, first call included: written to the JSON
ONE_GPU = ("transformers one GPU, eager", "transformers one GPU, compiled / static cache")
TP = "transformers tp_plan=auto, 2 GPUs, static cache"
TP_SYSTEMS = {"tp": ("transformers", TP), "devmap-tp": ("devmap", "devmap tensor parallel, 2 GPUs"),
              "devmap-tp-compiled": ("devmap-compiled", "devmap tensor parallel, 2 GPUs, compiled")}
TP_TIMEOUT = int(os.environ.get("DEVMAP_TP_TIMEOUT", "240"))


def measure(label: str, fn: Callable[[], Any], repeat: int) -> None:
    """First call and best of `repeat` more, every GPU synchronized around each call."""
    CALLS[label] = [timed(fn)[1] for _ in range(repeat + 1)]
    print(f"  {label}: first {CALLS[label][0]:.4f} s, best {min(CALLS[label][1:]):.4f} s", flush=True)


def busy_profile(fn: Callable[[], Any]) -> None:
    """Each GPU's busy time against its span for one call (after the calls that compile and capture)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, seconds = timed(fn)
    spans: dict[int, list[tuple[float, float]]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spans.setdefault(event.device_index, []).append((event.time_range.start, event.time_range.end))
    print(f"  profiled call: {seconds * 1e3:.1f} ms")
    for device, intervals in sorted(spans.items()):
        intervals.sort()
        busy, (start, end) = 0.0, intervals[0]
        first = start
        for a, b in intervals[1:]:
            if a > end:
                busy, start, end = busy + end - start, a, b
            else:
                end = max(end, b)
        busy += end - start
        print(f"  GPU {device}: {len(intervals)} kernels, busy {busy / 1e3:.2f} ms of its span "
              f"{(max(b for _, b in intervals) - first) / 1e3:.2f} ms")


def run_tp(model: torch.nn.Module, repeat: int, systems: list[str], size: int) -> None:
    """Save the one-GPU model once, then time each tensor-parallel system under torchrun (`size` processes)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEVMAP_BENCH_TMP")) as folder:
        start = time.perf_counter()
        model.save_pretrained(folder)
        print(f"  saved the checkpoint for TP in {time.perf_counter() - start:.1f} s", flush=True)
        for system in systems:
            script, label = TP_SYSTEMS[system]
            label = label.replace("2 GPUs", f"{size} GPUs")
            out = Path(folder) / f"{system}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size),
                       str(Path(__file__).with_name("llama_tp.py")), folder, str(out), str(repeat + 1), script]
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible.split(",")[:size])}  # N GPUs: TP alone
            ranks = subprocess.Popen(command, env=env, process_group=0)  # a group of its own: its ranks die with it
            try:
                failed = ranks.wait(timeout=TP_TIMEOUT) != 0 or not out.exists()
            except subprocess.TimeoutExpired:  # rank 0 writes its times before the ranks shut down
                failed = not out.exists()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(ranks.pid, signal.SIGKILL)
                ranks.wait()
            if failed:
                print(f"  {system} failed or ran past {TP_TIMEOUT} s (its output is above); no row", flush=True)
                continue
            result = json.loads(out.read_text())
            for workload in ("W3", "W4"):
                CALLS[f"{workload} {label}"] = seconds = result[workload]
                print(f"  {workload} {label}: first {seconds[0]:.4f} s, best {min(seconds[1:]):.4f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--systems", default="eager,compiled,tp,devmap-tp,accelerate,devmap,devmap-compiled")
    parser.add_argument("--tp-size", type=int, default=2, help="GPUs of the tensor-parallel systems")
    parser.add_argument("--prefill-lanes", default="8", help="devmap lane counts for W3")
    parser.add_argument("--generate-lanes", default="2", help="devmap lane counts for W4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--device-map", default="balanced", help="devmap's strategy, or a JSON file of a map")
    parser.add_argument("--profile", action="store_true", help="GPU busy time of devmap's last W3 and W4 calls")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    systems = args.systems.split(",")
    config = llama_config(args.model)
    generator = torch.Generator().manual_seed(0)
    prefill = torch.randint(0, config.vocab_size, (32, 512), generator=generator).to("cuda:0")
    prompt = torch.randint(0, config.vocab_size, (32, 64), generator=generator).to("cuda:0")

    def hf_generate(model: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      pad_token_id=0, **kwargs)

    with torch.no_grad():
        one = None
        tensor_parallel = [name for name in TP_SYSTEMS if name in systems]
        if {"eager", "compiled", "accelerate", *tensor_parallel} & set(systems):
            with torch.device("cuda:0"):
                one = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        if "eager" in systems:
            measure("W3 " + ONE_GPU[0], lambda: one(prefill), args.repeat)
            if not args.skip_generate:
                measure("W4 " + ONE_GPU[0], hf_generate(one), args.repeat)
        if "compiled" in systems:
            compiled = torch.compile(one)
            measure("W3 " + ONE_GPU[1], lambda: compiled(prefill), args.repeat)
            if not args.skip_generate:
                measure("W4 " + ONE_GPU[1], hf_generate(one, cache_implementation="static"), args.repeat)
            del compiled
        if tensor_parallel:
            run_tp(one, args.repeat, tensor_parallel, args.tp_size)
        if "accelerate" in systems:
            from accelerate import dispatch_model, infer_auto_device_map
            from accelerate.utils import get_balanced_memory

            budget = get_balanced_memory(one, dtype=torch.bfloat16, no_split_module_classes=["LlamaDecoderLayer"])
            device_map = infer_auto_device_map(one, budget, no_split_module_classes=["LlamaDecoderLayer"],
                                               dtype=torch.bfloat16)
            dispatched = dispatch_model(one, device_map)
            label = "accelerate dispatch (balanced)"
            measure("W3 " + label, lambda: dispatched(prefill), args.repeat)
            if not args.skip_generate:
                measure("W4 " + label, hf_generate(dispatched), args.repeat)
            del dispatched
        one = None  # noqa: F841 (frees the one-GPU weights before devmap loads)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
        device_map = args.device_map
        if device_map.endswith(".json"):
            device_map = json.loads(Path(device_map).read_text())
        start = time.perf_counter()
        model = devmap.load(args.model, device_map, dtype="bf16")
        print(f"  devmap.load: {time.perf_counter() - start:.1f} s", flush=True)
        if "hooks" in systems:
            label = "accelerate dispatch (devmap's map)"
            measure("W3 " + label, lambda: model(prefill), args.repeat)
            if not args.skip_generate:
                measure("W4 " + label, hf_generate(model), args.repeat)
        for name, compile in (("devmap", False), ("devmap-compiled", True)):
            if name not in systems:
                continue
            suffix = ", compiled" if compile else ""
            for lanes in [int(x) for x in args.prefill_lanes.split(",")]:
                call = lambda: forward(model, prefill, lanes=lanes, compile=compile)  # noqa: E731
                measure(f"W3 devmap (lanes {lanes}{suffix})", call, args.repeat)
            if args.profile:
                busy_profile(call)
            devmap.release_graphs(model)
            if args.skip_generate:
                continue
            for lanes in [int(x) for x in args.generate_lanes.split(",")]:
                call = lambda: generate(model, prompt, max_new_tokens=32, lanes=lanes, eos_token_id=[],  # noqa: E731
                                        compile=compile)
                measure(f"W4 devmap (lanes {lanes}{suffix})", call, args.repeat)
            if args.profile:
                busy_profile(call)
            devmap.release_graphs(model)
    report(args.model, args.out)


def report(model: str, out: str | None) -> None:
    """Per workload: steady seconds, tokens/s, first call, and ratios to the best one-GPU path and to TP."""
    for workload, unit in (("W3", 32 * 512), ("W4", 32 * 32)):
        rows = {k[3:]: v for k, v in CALLS.items() if k.startswith(workload)}
        if not rows:
            continue
        steady = {name: min(v[1:]) for name, v in rows.items()}
        one_gpu = min((steady[n] for n in ONE_GPU if n in steady), default=None)
        accelerate = next((steady[n] for n in steady if n.startswith("accelerate")), None)
        print(f"\n{workload} {'prefill 32 x 512' if workload == 'W3' else 'generate 32 x (64 + 32 new)'}, {model} "
              f"bf16, torch {torch.__version__}")
        print("| system | steady s | tokens/s | first call s | vs best one GPU | vs TP | vs accelerate |\n"
              "|---|---|---|---|---|---|---|")
        for name, seconds in steady.items():
            versus_one = f"{one_gpu / seconds:.2f}x" if one_gpu else "-"
            tp = next((steady[n] for n in steady if n.startswith("transformers tp_plan")), None)
            versus_tp = f"{tp / seconds:.2f}x" if tp else "-"
            versus_accelerate = f"{accelerate / seconds:.2f}x" if accelerate else "-"
            print(f"| {name} | {seconds:.4f} | {unit / seconds:,.0f} | {rows[name][0]:.2f} | {versus_one} | "
                  f"{versus_tp} | {versus_accelerate} |")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"llama_inference_{model}.json").write_text(json.dumps(CALLS, indent=2))


if __name__ == "__main__":
    main()
