"""Where a served decode step's GPU time goes, read off the engine core's own trace: kernels and the gaps between them.

Run on one GPU, after a serve run that profiled (`benchmarks/serve.py ... --profile-seconds 1 --out DIR`):
    python3 benchmarks/probes/step_timeline.py DIR/profiles/*.trace.json
Each trace's GPU kernels (those replayed inside CUDA graphs included) are summed by name and divided by the steps the
trace holds (the count of the kernels a step runs once): per step, the kernels' busy time, the GPU's idle time between
kernels (gaps up to `--gap` µs; longer ones are the host between steps), and per kernel name its calls, time and mean
idle time before each call. Run it on a trace of steady steps of one kind (one client's decode steps). The profiler
adds its own cost to each kernel record, so the idle times are upper bounds; the kernels' durations are the GPU's.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def events(trace: Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace, gzipped (`.gz`) or not."""
    with gzip.open(trace, "rt") if trace.suffix == ".gz" else trace.open() as f:
        loaded = json.load(f)
    found = loaded.get("traceEvents", loaded) if isinstance(loaded, dict) else loaded
    return [e for e in found if e.get("ph") == "X" and "ts" in e]


def kernels(trace: Path) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every GPU kernel in a Chrome trace, by start."""
    found = [(float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "?")))
             for e in events(trace) if e.get("cat") == "kernel"]
    return sorted(found)


def once_a_step(calls: Counter) -> int:
    """How many steps a trace holds: the fewest calls that at least three kernel names share (the kernels a step runs
    once: its embedding, its head, its sampling); a trace of one kind of step has them all at the same count."""
    shared = Counter(calls.values())
    counts = sorted(count for count, names in shared.items() if names >= 3)
    return counts[0] if counts else max(calls.values())


def short(name: str, width: int) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


def report(trace: Path, gap: float, top: int) -> None:
    found = kernels(trace)
    if not found:
        print(f"{trace.name}: no GPU kernels recorded")
        return
    calls = Counter(name for _, _, name in found)
    steps = once_a_step(calls)
    time_of: dict[str, float] = defaultdict(float)
    idle_of: dict[str, float] = defaultdict(float)
    idle, end = 0.0, found[0][0]
    for start, duration, name in found:
        wait = max(0.0, start - end)
        if wait <= gap:  # idle inside a step (longer waits are the host between steps)
            idle += wait
            idle_of[name] += wait
        time_of[name] += duration
        end = max(end, start + duration)
    busy = sum(time_of.values())
    print(f"{trace.name}: {len(found)} kernels over {steps} steps ({len(found) / steps:.0f} a step)")
    print(f"  per step: kernels busy {busy / steps:.1f} µs, idle between them {idle / steps:.1f} µs "
          f"({idle / len(found):.2f} µs before each)")
    print(f"  {'kernel':<70} {'calls':>6} {'µs/step':>9} {'µs each':>8} {'idle before':>11}")
    names = sorted(time_of, key=lambda n: -time_of[n])
    for name in names[:top]:
        print(f"  {short(name, 70):<70} {calls[name] / steps:>6.1f} {time_of[name] / steps:>9.1f} "
              f"{time_of[name] / calls[name]:>8.2f} {idle_of[name] / calls[name]:>11.2f}")
    rest = names[top:]
    if rest:
        print(f"  ({len(rest)} more names: {sum(time_of[n] for n in rest) / steps:.1f} µs/step)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--gap", type=float, default=40.0,
                        help="longest GPU idle (µs) counted as inside a step (default 40)")
    parser.add_argument("--top", type=int, default=25, help="kernel names listed (default 25)")
    args = parser.parse_args()
    for trace in args.traces:
        report(trace, args.gap, args.top)


if __name__ == "__main__":
    main()
