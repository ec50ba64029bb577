"""Where a cold `devmap.load` spends its time: one fresh process, each phase of the load timed on the host clock.

Run on nvidia-h200-x2 (after benchmarks/load.py wrote the checkpoint):
  PYTHONPATH=. python3 benchmarks/probes/load_phases.py --dir /tmp/devmap-bench/llama-2-7b
Prints seconds since the interpreter started for the imports, then each wrapped phase of the load (a phase
that contains another counts it too), then the time until both GPUs synchronize.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import functools  # noqa: E402

phases: list[tuple[str, float]] = []


def timed(owner, name: str, label: str) -> None:  # type: ignore[no-untyped-def]
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            phases.append((label, time.perf_counter() - t))

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/devmap-bench/llama-2-7b")
    parser.add_argument("--device-map", default="balanced")
    args = parser.parse_args()
    t = time.perf_counter()
    import torch

    phases.append(("import torch", time.perf_counter() - t))
    t = time.perf_counter()
    import devmap.loading.loader as loader
    from devmap.planning import models

    phases.append(("import devmap.loading.loader", time.perf_counter() - t))
    timed(loader, "resolve_source", "resolve_source (config)")
    timed(loader, "index_checkpoint", "index_checkpoint (headers)")
    timed(loader, "resolve_budget", "resolve_budget (GPU memory: CUDA init)")
    timed(models.ModelSource, "build", "build on meta (model class import)")
    timed(loader, "plan_model", "plan_model (placement)")
    timed(loader, "_materialize", "_materialize (allocate + copy)")
    timed(loader, "copy_into", "copy_into (reads + copies)")
    timed(loader, "_attach_hooks", "_attach_hooks (accelerate dispatch)")
    t = time.perf_counter()
    model = loader.load(args.dir, args.device_map, dtype="bf16")
    load_call = time.perf_counter() - t
    for g in range(torch.cuda.device_count()):
        torch.cuda.synchronize(g)
    end = time.perf_counter() - START
    print(f"{'phase':<44}{'seconds':>9}")
    for label, seconds in phases:
        print(f"{label:<44}{seconds:>9.3f}")
    print(f"{'load() call':<44}{load_call:>9.3f}")
    print(f"{'interpreter start -> weights on every GPU':<44}{end:>9.3f}")
    del model


if __name__ == "__main__":
    main()
