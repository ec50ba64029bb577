"""How long a light warm-up holds the interpreter while it loads a model's stored compiled regions: the stalls a
serving thread beside it would meet, and where the loading thread was when each ended.

A first start compiles its steps in a process of its own (`devmap.serving.compile_process`) and then loads the
stored entries beside its serving (a light warm-up); serving steps were seen to wait 0.6-0.8 s at a time meanwhile.
This probe builds the model cut down to one layer per device (random weights, as the compile's process does), has the
compile's process fill an empty region store for it, then runs the light warm-up here while a ticker thread asks for
the interpreter every millisecond. Every wait of the ticker longer than `--stall` is printed with the loading
thread's innermost frames at its end (where a long call that held the interpreter had just returned, or was still).

    PYTHONPATH=. python3 benchmarks/probes/store_load_stalls.py DIR --store /tmp/probe-store

DIR: a model directory (`devmap save llama-2-13b DIR --config-only`); one GPU (`--device cpu`: a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (its config.json is read; no weights)")
    parser.add_argument("--store", default=None, help="the region store's folder (default: a new temporary one)")
    parser.add_argument("--rows", type=int, default=64, help="the served model's largest batch, in rows")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--stall", type=float, default=0.02, help="seconds: longer waits are printed")
    parser.add_argument("--device", default="0", help="a GPU index, or cpu (inductor's C++ code: a smoke run)")
    args = parser.parse_args()

    from devmap.serving.compile_cache import REGIONS

    store = Path(args.store or tempfile.mkdtemp(prefix="store-"))
    os.environ[REGIONS] = str(store)  # where the compile's process keeps them
    import torch

    from devmap.generation import region_store
    from devmap.generation.joined_projections import join_projections
    from devmap.loading.loader import load
    from devmap.serving.compile_process import CompileJob, compile_elsewhere, cut_down
    from devmap.serving.prepare import pin_attention
    from devmap.serving.stall_sampler import thread_frame
    from devmap.serving.warm_up import warm_up

    config = json.loads((Path(args.model) / "config.json").read_text())
    small, device_map = cut_down(config, {"": args.device})
    folder = Path(tempfile.mkdtemp(prefix="cut-"))
    (folder / "config.json").write_text(json.dumps(small))
    model = load(str(folder), device_map=device_map, dtype="bfloat16", random_weights=True)
    join_projections(model)
    pin_attention(model)
    key = "store-load-stalls"
    job = CompileJob(config=small, device_map=device_map, dtype="bfloat16", quantization=None, rows=args.rows,
                     context=args.context, riding=True, threads=torch.get_num_threads(), key=key,
                     memory={} if args.device == "cpu" else {args.device: 8 << 30})
    started = time.perf_counter()
    if compile_elsewhere(job, lambda: False) is None:
        sys.exit("the compile's process failed (its reason is logged above)")
    print(f"the compile's process filled {store} in {time.perf_counter() - started:.1f} s")

    region_store.keep_regions_in(store)
    main_thread, stalls, done = threading.main_thread().ident, [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            asked = time.perf_counter()
            time.sleep(0.001)
            waited = time.perf_counter() - asked - 0.001
            if waited > args.stall:
                frame = thread_frame(main_thread)
                where = traceback.extract_stack(frame)[-3:] if frame is not None else []
                stalls.append((time.perf_counter() - started, waited, where))

    ticker = threading.Thread(target=tick, daemon=True)
    started = time.perf_counter()
    ticker.start()
    times = warm_up(model, args.rows, args.context, True, beside_serving=True, key=key)
    done.set()
    ticker.join()
    print(f"light warm-up {time.perf_counter() - started:.2f} s: {times.compile:.2f} s loading ({times.graphs.total} "
          f"graphs, {times.graphs.from_cache} stored), {times.warm_up:.2f} s running; "
          f"{region_store.region_totals().compiled} compiled here")
    print(f"{len(stalls)} waits over {args.stall * 1000:.0f} ms, {sum(s[1] for s in stalls):.2f} s in all; longest:")
    for at, waited, where in sorted(stalls, key=lambda s: -s[1])[:12]:
        frames = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where))
        print(f"  {waited * 1000:7.1f} ms at {at:6.2f} s: {frames}")


if __name__ == "__main__":
    main()
