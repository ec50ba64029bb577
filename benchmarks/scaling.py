"""Scaling on N GPUs: W2 (ResNet50 training at 224x224) and W3 (LLaMA prefill, 7B shape), devmap vs one GPU.

Run on nvidia-h200-x4 or nvidia-h200-x8 (all visible GPUs are used unless --gpus says fewer):
  PYTHONPATH=. python3 benchmarks/scaling.py --out $OUT
W2: the batch grows with the GPUs (--w2-rows-per-gpu each) so every stage stays GPU-bound; one GPU runs the
largest batch of at most --w2-one-gpu-batch rows, and the efficiency compares images/s (speed-up / GPUs).
W3: batch --w3-batch x 512 tokens; one GPU, accelerate's dispatch over the N GPUs (balanced) and devmap's
forward (lanes 4 per stage), seconds per forward. Every system is measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torchvision

import devmap
from devmap.generation import forward, timed
from devmap.planning.models import llama_config
from devmap.pipelining.stages import blocks_of


def time_training(model: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    """Seconds per step (forward, MSE on one-hot labels, backward, SGD) after 3 warm-up steps."""
    labels = torch.zeros(x.shape[0], 1000, device=x.device).scatter_(
        1, torch.randint(0, 1000, (x.shape[0], 1), device=x.device), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        torch.nn.functional.mse_loss(out, labels.to(out.device)).backward()
        optimizer.step()

    for _ in range(3):
        step()
    return min(timed(lambda: [step() for _ in range(steps)])[1] / steps for _ in range(2))


def run_w2(gpus: int, args: argparse.Namespace) -> dict:
    batch = args.w2_rows_per_gpu * gpus
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device="cuda:0")
    one_batch = min(batch, args.w2_one_gpu_batch)
    one = torchvision.models.resnet50().to("cuda:0")
    one_s = time_training(one, x[:one_batch], args.steps)
    del one
    torch.cuda.empty_cache()
    model = torchvision.models.resnet50()
    names = [n for n, _ in blocks_of(model) if n != "flatten"]
    devmap.dispatch(model, {n: i * gpus // len(names) for i, n in enumerate(names)})  # equal block counts to start
    chunks = args.chunks or 4 * gpus
    pipe = devmap.pipeline(model, chunks=chunks, balance="measure" if args.refine else "time", sample=x).prepare(x)
    devmap_s = time_training(pipe, x, args.steps)
    one_rate, devmap_rate = one_batch / one_s, batch / devmap_s
    row = {"gpus": gpus, "batch": batch, "chunks": chunks, "one_gpu_batch": one_batch,
           "one_gpu_images_per_s": one_rate, "devmap_images_per_s": devmap_rate,
           "speedup": devmap_rate / one_rate, "efficiency": devmap_rate / one_rate / gpus,
           "stage_ends": [names_[-1] for names_ in pipe.block_names]}
    del pipe, model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def run_w3(gpus: int, args: argparse.Namespace) -> dict:
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    from transformers import AutoModelForCausalLM

    config = llama_config(args.w3_model)
    ids = torch.randint(0, config.vocab_size, (args.w3_batch, 512), device="cuda:0")
    seconds: dict[str, float] = {}

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        fn()  # devmap captures its graphs in its first two calls
        return min(timed(fn)[1] for _ in range(args.repeat))

    held: dict[str, torch.nn.Module] = {}  # models by role, dropped as soon as they are measured
    with torch.device("cuda:0"):
        held["one"] = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        seconds["one GPU"] = best(lambda: held["one"](ids))
        classes = ["LlamaDecoderLayer"]
        budget = get_balanced_memory(held["one"], dtype=torch.bfloat16, no_split_module_classes=classes)
        device_map = infer_auto_device_map(held["one"], budget, no_split_module_classes=classes, dtype=torch.bfloat16)
        held["accelerate"] = dispatch_model(held.pop("one"), device_map)
        seconds[f"accelerate dispatch over {gpus}"] = best(lambda: held["accelerate"](ids))
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
    held["devmap"] = devmap.load(args.w3_model, "balanced", dtype="bf16")
    seconds[f"devmap over {gpus} (lanes {4 * gpus})"] = best(lambda: forward(held["devmap"], ids, lanes=4 * gpus))
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
    base = seconds["one GPU"]
    return {"gpus": gpus, "seconds": seconds,
            "speedup": {k: base / v for k, v in seconds.items()},
            "efficiency": {k: base / v / gpus for k, v in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    parser.add_argument("--w2-rows-per-gpu", type=int, default=256)
    parser.add_argument("--w2-one-gpu-batch", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=0, help="micro-batches (default 4 per GPU)")
    parser.add_argument("--refine", action="store_true", help="balance='measure' (slower set-up, better split)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--w3-model", default="llama-2-7b")
    parser.add_argument("--w3-batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-w2", action="store_true")
    parser.add_argument("--skip-w3", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 2 or gpus > torch.cuda.device_count():
        parser.error(f"--gpus must be between 2 and the {torch.cuda.device_count()} visible GPUs")
    results = {}
    if not args.skip_w2:
        w2 = results["w2"] = run_w2(gpus, args)
        print(f"W2 ResNet50 training, {gpus} GPUs, batch {w2['batch']} (chunks {w2['chunks']}), torch "
              f"{torch.__version__}: one GPU {w2['one_gpu_images_per_s']:.0f} images/s (batch {w2['one_gpu_batch']}), "
              f"devmap {w2['devmap_images_per_s']:.0f} images/s = {w2['speedup']:.2f}x, efficiency "
              f"{w2['efficiency']:.2f}; stages end at {w2['stage_ends']}", flush=True)
    if not args.skip_w3:
        w3 = results["w3"] = run_w3(gpus, args)
        print(f"\nW3 {args.w3_model} prefill {args.w3_batch} x 512, {gpus} GPUs")
        print(f"{'system':<36}{'seconds':>9}{'speed-up':>10}{'efficiency':>12}")
        for name, s in w3["seconds"].items():
            print(f"{name:<36}{s:>9.4f}{w3['speedup'][name]:>9.2f}x{w3['efficiency'][name]:>12.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"scaling_{gpus}gpus.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
