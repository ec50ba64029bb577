"""A serving thread beside a compiling one: how the interpreter's switch interval changes the serving thread's steps.

An engine core's process runs its batches in one thread while another compiles (a model loaded over HTTP, or
`--compile-beside`): dynamo's tracing holds the interpreter for long stretches, and a thread waiting for it gets it
back only at the next forced switch (`sys.setswitchinterval`, Python's default 5 ms). This probe steps a continuous
batch of a tiny LLaMA on the CPU in one thread while another thread compiles a second model (aot_eager: tracing
only), each interval in a fresh process, rounds interleaved, and prints the serving thread's step times alone and
beside the compile, and how long the compile took.

Run:  PYTHONPATH=. python3 benchmarks/probes/gil_switch.py --intervals 0.005,0.0005 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def run_one(interval: float, rows: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from devmap.generation.continuous import SlotRequest, continuous_batch

    sys.setswitchinterval(interval)
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def tiny(layers: int) -> torch.nn.Module:
        return AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)).eval()

    served, compiled = tiny(2), tiny(8)
    times: list[float] = []
    stop, beside = threading.Event(), threading.Event()
    marks: dict[str, int] = {}

    def serve() -> None:
        with torch.no_grad(), continuous_batch(served, rows=rows, first_slot=32, cache_len=128) as batch:
            n = 0
            while not stop.is_set():
                free = batch.free_count()
                joining = [SlotRequest([5 + (n + k) % 400] * 8, 64, n + k) for k in range(min(free, 2))]
                n += len(joining)
                started = time.perf_counter()
                batch.step(joining)
                batch.collect()
                times.append(time.perf_counter() - started)
                if beside.is_set() and "beside" not in marks:
                    marks["beside"] = len(times)

    thread = threading.Thread(target=serve)
    thread.start()
    time.sleep(3.0)
    alone_end = len(times)
    beside.set()
    started = time.perf_counter()
    step = torch.compile(compiled, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        step(torch.randint(0, 512, (1, 16)))
    compile_s = time.perf_counter() - started
    end = len(times)
    stop.set()
    thread.join()
    alone, during = sorted(times[20:alone_end]), sorted(times[marks.get("beside", alone_end):end])

    def q(values: list[float], share: float) -> float:
        return 1000 * values[int(share * (len(values) - 1))] if values else float("nan")

    return {"interval_ms": interval * 1000, "alone_p50_ms": q(alone, 0.5), "alone_p99_ms": q(alone, 0.99),
            "beside_p50_ms": q(during, 0.5), "beside_p99_ms": q(during, 0.99),
            "beside_mean_ms": 1000 * sum(during) / max(1, len(during)), "beside_max_ms": q(during, 1.0),
            "compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--intervals", default="0.005,0.0005")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.rows)))
        return
    print("| switch interval ms | alone p50 / p99 ms | beside a compile: p50 / p99 / mean / max ms | compile s |")
    print("|---|---|---|---|")
    for _ in range(args.rounds):
        for interval in (float(i) for i in args.intervals.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(interval), "--rows", str(args.rows)],
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"| {interval * 1000:g} | failed: {out.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {r['interval_ms']:g} | {r['alone_p50_ms']:.2f} / {r['alone_p99_ms']:.2f} | "
                  f"{r['beside_p50_ms']:.2f} / {r['beside_p99_ms']:.2f} / {r['beside_mean_ms']:.2f} / "
                  f"{r['beside_max_ms']:.1f} | {r['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
