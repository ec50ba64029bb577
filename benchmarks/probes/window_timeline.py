"""How a profiled serving window unfolds over time, read off the engine core's own trace: per time bucket, the GPU's
busy share, the CUDA graphs replayed, the kernels launched one by one (steps running uncaptured), the captures, and
the host ops that took the bucket's time.

Run on the machine that served, after a serve run that profiled (`benchmarks/serve.py ... --restart
--profile-seconds 1.5 --out DIR`: its first window after a restart, or beside a compile):
    python3 benchmarks/probes/window_timeline.py DIR/profiles/*.trace.json --bucket 100
A window whose steps replay their graphs shows a few graph launches and a busy GPU in every bucket; one whose steps
run uncaptured (a batch shape's or a pack width's first use, eager steps beside a compile) shows hundreds of kernel
launches, calls of compiled graphs and an idle GPU; a capture shows as a capture's begin. The profiler adds its own
cost to every op, so a bucket's host work runs slower than it would unprofiled: read the timeline's shape, not its
speed. docs/serving.md has what it showed for a restart's first window.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from step_timeline import events  # this folder's: run as a script, like it

HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class Bucket:
    """What one time bucket of a trace holds."""

    gpu_us: float = 0.0  # the GPU's kernels and copies, summed (overlaps count twice: an upper bound)
    graphs: int = 0  # CUDA graph launches (replayed steps)
    launches: int = 0  # single kernel launches (uncaptured work)
    captures: int = 0  # graph capture begins
    host: Counter = field(default_factory=Counter)  # host op name: µs (inclusive: nested ops count in each)


def buckets(trace: Path, width_ms: float) -> list[Bucket]:
    """The trace's events in buckets of `width_ms`, from its first event on."""
    found = events(trace)
    if not found:
        return []
    start = min(float(e["ts"]) for e in found)
    out: dict[int, Bucket] = {}
    for e in found:
        bucket = out.setdefault(int((float(e["ts"]) - start) // (width_ms * 1000)), Bucket())
        category, name, duration = e.get("cat"), str(e.get("name", "?")), float(e.get("dur", 0.0))
        if category in GPU_CATEGORIES:
            bucket.gpu_us += duration
        elif category in RUNTIME_CATEGORIES:
            bucket.graphs += "GraphLaunch" in name
            bucket.launches += "LaunchKernel" in name
            bucket.captures += "BeginCapture" in name
        elif category in HOST_CATEGORIES:
            bucket.host[name] += duration
    return [out.get(k, Bucket()) for k in range(max(out) + 1)]


def report(trace: Path, width_ms: float, ops: int) -> None:
    timeline = buckets(trace, width_ms)
    print(f"{trace.name}: {len(timeline)} buckets of {width_ms:g} ms")
    print(f"  {'from s':>7} {'GPU busy':>8} {'graphs':>6} {'launches':>8} {'captures':>8}  host ops (ms, inclusive)")
    for k, bucket in enumerate(timeline):
        busy = min(100.0, bucket.gpu_us / (width_ms * 10))
        top = ", ".join(f"{name[:36]} {us / 1000:.0f}" for name, us in bucket.host.most_common(ops))
        print(f"  {k * width_ms / 1000:>7.2f} {busy:>7.1f}% {bucket.graphs:>6} {bucket.launches:>8} "
              f"{bucket.captures:>8}  {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="engine core traces (.trace.json, or gzipped)")
    parser.add_argument("--bucket", type=float, default=100.0, help="bucket width in ms (default 100)")
    parser.add_argument("--ops", type=int, default=3, help="host ops listed per bucket (default 3)")
    args = parser.parse_args()
    for trace in args.traces:
        report(trace, args.bucket, args.ops)


if __name__ == "__main__":
    main()
