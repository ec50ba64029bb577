"""Where a service's start goes: the engine core's imports, and one model's load (plan, weights, prepare, compile,
capture, warm-up) as `devmap serve` makes it, in this fresh process, under cProfile.

Run it twice on one compile cache: the first start fills the cache, the second is a restart. Each run prints the
load's phases, the seconds of each import group, and where the load's time went: by default a sampling profile of
the loading thread (its stack every few milliseconds: the functions most often on it, and the innermost ones), which
torch.compile's frame evaluation leaves intact; `--cprofile` uses cProfile instead (deterministic, but dynamo's
frames confuse its accounting) and writes it to `--out FILE.prof`.

    PYTHONPATH=. python3 benchmarks/probes/start_profile.py DIR --load-format dummy --cache /tmp/cc --out a.prof
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import threading
import time

STARTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (devmap save MODEL DIR [--config-only])")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--cache", default=None, help="the compile cache folder (devmap serve --compile-cache)")
    parser.add_argument("--device-map", default="balanced")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--compile-beside", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between two samples")
    parser.add_argument("--focus", default="make_llir,make_ptx,triton_key,compile_wrapper,capture_end",
                        help="frames (substrings of file:line(function)) whose samples are traced back to devmap's "
                             "innermost frame and the kernel or function under it")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from devmap.serving.compile_cache import keep_regions, use_compile_cache

    use_compile_cache(args.cache)
    keep_regions()  # as the engine core does: the regions' store, so that a second run is a restart
    marks = [("interpreter", time.perf_counter() - STARTED)]
    begun = time.perf_counter()
    import torch

    marks.append(("torch", time.perf_counter() - begun))
    begun = time.perf_counter()
    torch.cuda.init() if torch.cuda.is_available() else None
    marks.append(("cuda init", time.perf_counter() - begun))
    begun = time.perf_counter()
    from devmap.serving.core_client import import_model_stack

    import_model_stack()
    marks.append(("transformers, accelerate", time.perf_counter() - begun))
    begun = time.perf_counter()
    from pathlib import Path

    from devmap.serving.limits import EngineLimits
    from devmap.serving.registry import ModelRegistry

    marks.append(("devmap serving", time.perf_counter() - begun))
    limits = EngineLimits(max_batch=args.max_batch, compile_beside=args.compile_beside)
    registry = ModelRegistry(None, args.device_map, limits=limits, random_weights=args.load_format == "dummy")
    profile = cProfile.Profile() if args.cprofile else None
    sampler = None if args.cprofile else Sampler(threading.get_ident(), args.interval, args.focus.split(","))
    begun = time.perf_counter()
    if profile is not None:
        profile.enable()
    else:
        sampler.start()
    resident = registry.load(Path(args.model))
    if profile is not None:
        profile.disable()
    else:
        sampler.stop()
    marks.append(("load", time.perf_counter() - begun))
    print("start:", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in marks))
    print("load phases:", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in resident.load_seconds.items()),
          f"({resident.compiled_graphs.describe() if resident.compiled_graphs else 'no compile'})")
    if sampler is not None:
        print(sampler.report(args.top))
        return
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
        print(text.getvalue())
    if args.out:
        profile.dump_stats(args.out)


class Sampler(threading.Thread):
    """The stack of one thread every `interval` seconds: how many samples each function was on it (inclusive) and
    innermost (its own time), and the innermost frames grouped by file."""

    def __init__(self, ident: int, interval: float, focus: list[str]) -> None:
        super().__init__(daemon=True)
        self.target, self.interval, self.running = ident, interval, True
        self.focus = [f for f in focus if f]
        self.focused: collections.Counter = collections.Counter()
        self.inclusive: collections.Counter = collections.Counter()
        self.own: collections.Counter = collections.Counter()
        self.files: collections.Counter = collections.Counter()
        self.samples = 0

    def run(self) -> None:
        from devmap.serving.stall_sampler import thread_frame

        while self.running:
            time.sleep(self.interval)
            frame = thread_frame(self.target)
            if frame is None:
                continue
            self.samples += 1
            seen = set()
            innermost = True
            stack = []
            while frame is not None:
                code = frame.f_code
                key = f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"
                stack.append(key)
                if innermost:
                    self.own[key] += 1
                    self.files[_package(code.co_filename)] += 1
                    innermost = False
                if key not in seen:
                    self.inclusive[key] += 1
                    seen.add(key)
                frame = frame.f_back
            for focus in self.focus:
                if any(focus in key for key in stack):
                    ours = next((key for key in stack if "/devmap/" in key), "-")
                    self.focused[f"{focus} <- {ours.split('/devmap/')[-1]}"] += 1

    def stop(self) -> None:
        self.running = False
        self.join()

    def report(self, top: int) -> str:
        total = max(1, self.samples)
        lines = [f"{self.samples} samples"]
        for title, counter in (("on the stack", self.inclusive), ("innermost", self.own),
                               ("innermost, by package", self.files), ("focused frames, by devmap's caller",
                                                                       self.focused)):
            lines.append(f"-- {title}")
            lines += [f"{100 * n / total:5.1f}%  {key}" for key, n in counter.most_common(top)]
        return "\n".join(lines)


def _package(filename: str) -> str:
    """'torch/_dynamo', 'transformers', 'devmap/generation', '<built-in>' for a frame's file."""
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("site-packages", "main", "devmap"):
        if anchor in parts[:-1]:
            rest = parts[parts.index(anchor) + 1:-1]
            return "/".join(rest[:2]) or parts[-1]
    return filename


if __name__ == "__main__":
    main()
