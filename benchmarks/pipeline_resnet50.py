"""W1 (the tutorial's harness) and W2 (GPU-bound, 224x224) for ResNet50 on 2 GPUs: devmap's pipeline vs the rest.

Run on nvidia-h200-x2:
  PYTHONPATH=. python3 benchmarks/pipeline_resnet50.py --w1 --out $OUT
  PYTHONPATH=. python3 benchmarks/pipeline_resnet50.py --w2 --out $OUT
Every system is measured in the same run; the tables give ratios to one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torchvision
from torch import nn

from devmap.loading.loader import dispatch
from devmap.pipelining import pipeline
from devmap.comparison.compare_systems import stages_from_names

from common import time_steps, training_step  # noqa: F401 (shared by the W2 scripts)

TUTORIAL_SPLIT = {"conv1": 0, "bn1": 0, "relu": 0, "maxpool": 0, "layer1": 0, "layer2": 0,
                  "layer3": 1, "layer4": 1, "avgpool": 1, "fc": 1}


def balanced_resnet(micro: torch.Tensor, chunks: int):  # type: ignore[no-untyped-def]
    """ResNet50 over cuda:0/cuda:1, stage boundary balanced by measured time at this micro-batch size."""
    model = torchvision.models.resnet50()
    dispatch(model, TUTORIAL_SPLIT)
    return model, pipeline(model, chunks=chunks, balance="time", sample=micro)


def one_gpu_two_stages(model: nn.Module, names: list[list[str]], chunks: int):  # type: ignore[no-untyped-def]
    """The same stages, both on cuda:0: what lower launch overhead alone buys."""
    return pipeline(stages_from_names(model, names, [torch.device("cuda:0")] * 2), chunks=chunks)


# ---------------------------------------------------------------- W1
def run_w1(args: argparse.Namespace) -> dict:
    """The same systems `devmap compare` times (devmap's tuned once, outside the timed runs)."""
    from devmap.comparison.compare_systems import devmap_systems
    from devmap.comparison.timing import HarnessConfig, run_comparison

    config = HarnessConfig(split_sizes=tuple(int(s) for s in args.split_sizes.split(",")), warmup=1)
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    result = run_comparison(devices, config, extra_systems=devmap_systems(devices, config))
    data = result.to_dict()
    single = data["systems"]["Single GPU"]["mean"]
    print(f"\nW1 — the tutorial's harness (ResNet50, 3 x 120 images at 128x128, timeit repeat=10), "
          f"torch {torch.__version__}")
    print(f"{'system':<44}{'s per train()':>18}{'vs one GPU':>14}")
    rows = [(k, v["mean"], v["std"]) for k, v in data["systems"].items()]
    best = min(data["sweep"], key=lambda p: p["mean"])
    rows.insert(3, (f"Pipelining Model Parallel, best split ({best['split_size']})", best["mean"], best["std"]))
    for name, mean, std in rows:
        print(f"{name:<44}{mean:>10.3f} ± {std:.3f}{single / mean:>13.2f}x")
    print("sweep: " + ", ".join(f"{p['split_size']}: {p['mean']:.3f}" for p in data["sweep"]))
    return {"w1": data}


# ---------------------------------------------------------------- W2
def run_w2(args: argparse.Namespace) -> dict:
    from devmap.comparison import tutorial_models as tm

    out: dict = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        torch.manual_seed(0)
        x = torch.randn(batch, 3, 224, 224, device="cuda:0")
        labels = torch.zeros(batch, 1000, device="cuda:0").scatter_(
            1, torch.randint(0, 1000, (batch, 1), device="cuda:0"), 1)
        rows: dict[str, float] = {}
        steps = args.steps if batch <= 256 else max(4, args.steps // 2)
        model = torchvision.models.resnet50().to("cuda:0")
        rows["one GPU (eager)"] = time_steps(model, x, labels, steps)
        del model
        for split in () if args.skip_peers else (None, batch // 8, batch // 4):
            if split is None:
                model = tm.ModelParallelResNet50(["cuda:0", "cuda:1"])
                rows["tutorial model parallel"] = time_steps(model, x, labels, steps)
            else:
                model = tm.PipelineParallelResNet50(["cuda:0", "cuda:1"], split_size=split)
                rows[f"tutorial pipeline (split {split})"] = time_steps(model, x, labels, steps)
            del model
        torch.cuda.empty_cache()
        splits: dict[int, str] = {}
        names = None
        for chunks in [int(c) for c in (args.chunks_256 if batch <= 256 else args.chunks_1024).split(",")]:
            try:
                model, pipe = balanced_resnet(x[: batch // chunks], chunks)
                pipe.prepare(x)
                rows[f"devmap pipeline (chunks {chunks})"] = time_steps(pipe, x, labels, steps)
                print(f"  devmap chunks {chunks}, balance 'time': stage 0 ends at {pipe.block_names[0][-1]}",
                      flush=True)
                if args.refine:  # whole-block split refined by measured steps, then a block cut at the boundary
                    del pipe
                    pipe = pipeline(model, chunks=chunks, balance="measure", sample=x).prepare(x)
                    rows[f"devmap pipeline (chunks {chunks}, split measured: {pipe.block_names[0][-1]})"] = \
                        time_steps(pipe, x, labels, steps)
            except torch.OutOfMemoryError as exc:
                print(f"  devmap chunks {chunks}: out of memory ({str(exc).splitlines()[0][:120]})", flush=True)
                torch.cuda.empty_cache()
                continue
            splits[chunks] = pipe.block_names[0][-1]
            print(f"  devmap chunks {chunks}: stage 0 ends at {splits[chunks]}; failures {pipe.graph_failures}",
                  flush=True)
            names = pipe.block_names
            del model, pipe
            torch.cuda.empty_cache()
        for chunks in (1, 2) if names and not args.skip_peers else ():
            pipe = one_gpu_two_stages(torchvision.models.resnet50(), names, chunks).prepare(x)
            rows[f"devmap pipeline, 1 GPU (chunks {chunks})"] = time_steps(pipe, x, labels, steps)
            del pipe
            torch.cuda.empty_cache()
        best = [splits[min(splits, key=lambda c: rows[f"devmap pipeline (chunks {c})"])]] if splits else []
        best = [s for s in best if "[" not in s]  # torch.distributed.pipelining splits between whole blocks only
        for split in () if args.skip_peers else dict.fromkeys([*best, "layer2.0"]):
            chunks = args.chunks_256 if batch <= 256 else args.chunks_1024
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   str(Path(__file__).with_name("tdp_resnet50.py")), "--batch", str(batch), "--chunks", chunks,
                   "--split", split, "--steps", str(steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": "."})
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    rows[f"{r['system']} (split {split}, chunks {r['chunks']})"] = r["ms"]
            if proc.returncode != 0:
                print(f"torch.distributed.pipelining failed: {proc.stderr[-2000:]}", flush=True)
        base = rows["one GPU (eager)"]
        print(f"\nW2 — ResNet50 training step at 224x224, batch {batch}, inputs on the GPU, torch {torch.__version__}")
        print(f"{'system':<66}{'ms/step':>9}{'images/s':>10}{'vs one GPU':>12}")
        for name, ms in rows.items():
            print(f"{name:<66}{ms:>9.1f}{batch / ms * 1000:>10.0f}{base / ms:>11.2f}x")
        out[str(batch)] = rows
    return {"w2": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w1", action="store_true")
    parser.add_argument("--w2", action="store_true")
    parser.add_argument("--split-sizes", default="10,20,30,40,60")
    parser.add_argument("--batches", default="256,1024")
    parser.add_argument("--chunks-256", default="4,8")
    parser.add_argument("--chunks-1024", default="8,16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--refine", action="store_true", help="also refine devmap's split by measured steps")
    parser.add_argument("--skip-peers", action="store_true", help="only one GPU and devmap (peers measured before)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    if args.w1:
        results |= run_w1(args)
    if args.w2:
        results |= run_w2(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "pipeline_" + "_".join(k for k in ("w1", "w2") if getattr(args, k)) + ".json"
        (Path(args.out) / name).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
