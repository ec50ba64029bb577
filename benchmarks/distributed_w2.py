"""W2 on torch.distributed.pipelining: devmap's split under torchrun (each schedule) against devmap's
single-process pipeline, one GPU and DistributedDataParallel, same run.

Run on nvidia-h200-x2 and nvidia-h200-x4 (all visible GPUs):
  PYTHONPATH=. python3 benchmarks/distributed_w2.py --batch 256,1024 --out $OUT
The single-process pipeline is balanced by time (`balance="time"`); its stage split is handed to the distributed
runs (`--device-map`) so both run the same stages; interleaved and zb use twice as many FLOP-balanced stages.
Reported: images/s per system, the distributed path against the single-process pipeline, and scaling
efficiency (images/s ÷ one GPU's ÷ GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torchvision

import devmap
from devmap.pipelining.stages import blocks_of
from scaling import time_training

HERE = Path(__file__).resolve().parent


def torchrun(gpus: int, *args: str) -> dict | None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), *args]
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  failed: {' '.join(args[:4])} ...\n{done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(lines[-1])


def best(seconds: list[float], warmup: int = 2) -> float:
    return min(seconds[warmup:] if len(seconds) > warmup else seconds)


def run(batch: int, gpus: int, args: argparse.Namespace, folder: Path) -> list[dict]:
    rows = []
    x = torch.randn(batch, 3, 224, 224, device="cuda:0")
    one_batch = min(batch, args.one_gpu_batch)
    one = torchvision.models.resnet50().to("cuda:0")
    one_rate = one_batch / time_training(one, x[:one_batch], args.steps)
    del one
    model = torchvision.models.resnet50()
    names = [n for n, _ in blocks_of(model) if n != "flatten"]
    devmap.dispatch(model, {n: i * gpus // len(names) for i, n in enumerate(names)})
    chunks = args.chunks or 4 * gpus
    pipe = devmap.pipeline(model, chunks=chunks, balance="time", sample=x).prepare(x)
    devmap_rate = batch / time_training(pipe, x, args.steps)
    split = dict(model.hf_device_map)  # the time-balanced placement, residual cuts included; devices = stages
    del pipe, model
    torch.cuda.empty_cache()
    map_file = folder / f"map_{gpus}_{batch}.json"
    map_file.write_text(json.dumps(split))
    rows += [{"system": "one GPU", "images_per_s": one_rate},
             {"system": f"devmap single process (chunks {chunks})", "images_per_s": devmap_rate}]
    common = ["--model", "resnet50", "--batch-size", str(batch), "--chunks", str(chunks), "--steps",
              str(args.steps + 2), "--json"]
    for schedule in args.schedules.split(","):
        where = ["--device-map", str(map_file)] if schedule in ("gpipe", "1f1b") else ["--stages", str(2 * gpus)]
        result = torchrun(gpus, "-m", "devmap", "train", *common, *where, "--schedule", schedule)
        if result is not None:
            rows.append({"system": f"devmap on torch.distributed.pipelining, {schedule}",
                         "images_per_s": batch / best(result["step_seconds"])})
    result = torchrun(gpus, str(HERE / "ddp_resnet50.py"), "--batch", str(batch), "--steps", str(args.steps + 2))
    if result is not None:
        rows.append({"system": "DistributedDataParallel", "images_per_s": batch / best(result["step_seconds"])})
    for row in rows:
        row.update(batch=batch, gpus=gpus, vs_single_process=row["images_per_s"] / devmap_rate,
                   efficiency=row["images_per_s"] / one_rate / gpus)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="256,1024")
    parser.add_argument("--chunks", type=int, default=0, help="micro-batches (default 4 per GPU)")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb")
    parser.add_argument("--one-gpu-batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for batch in [int(b) for b in args.batch.split(",")]:
            rows += run(batch, gpus, args, Path(folder))
    print(f"\nW2 ResNet50 224², {gpus} GPUs, torch {torch.__version__}")
    print("| batch | system | images/s | vs devmap single process | scaling efficiency |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['system']} | {r['images_per_s']:,.0f} | {r['vs_single_process']:.2f}x | "
              f"{r['efficiency']:.2f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"distributed_w2_{gpus}gpus.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
