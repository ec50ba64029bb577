"""What compiling a continuous batch's steps costs, region by region (devmap) against each stage step compiled whole.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/probes/compile_regions.py --model tinyllama-1.1b
On a CPU (tracing only, aot_eager, random tiny LLaMAs of several depths):
                 PYTHONPATH=. python3 benchmarks/probes/compile_regions.py --tiny 4,16 --backend aot_eager

Each (model, mode) runs in a fresh process with an empty inductor cache of its own (a cold start), then once more with
that cache filled (a restart): a small continuous batch's first steps (compiling and capturing its decode step, and
its joins' steps) as a service's warm-up runs them, then decode steps of its rows. Prints per run the seconds of the
first batch, dynamo's and AOT autograd's share, the graphs compiled, and the milliseconds per decode step once warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_one(model_name: str, mode: str, backend: str, rows: int, steps: int) -> dict:
    import torch
    from torch._dynamo.utils import compile_times, counters

    from devmap.generation import compiled, lanes
    from devmap.generation.continuous import SlotRequest, continuous_batch

    compiled.BACKEND = backend
    if mode == "whole":  # every stage step compiled whole, its regions eager (how devmap compiled before)
        def whole(runner: lanes.LaneStreams, body):
            return compiled.compile_region(body, runner.dynamic) if runner.compile else body

        lanes.LaneStreams.compiled_body = whole
    model = _model(model_name)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    with continuous_batch(model, rows=rows, first_slot=64, cache_len=256, compile=True) as batch:
        batch.step([SlotRequest(torch.randint(3, vocab, (16,)).tolist(), 8, i) for i in range(rows // 2)])
        for i in range(64):  # two join later (their joins' steps compile too), then until every row is done
            if not batch.step([SlotRequest(torch.randint(3, vocab, (24,)).tolist(), 8, ("late", i))] if i < 2
                              else []):
                break
        batch.collect(everything=True)
        synchronize()
        first = time.perf_counter() - start
        batch.step([SlotRequest(torch.randint(3, vocab, (16,)).tolist(), steps + 8, ("row", i))
                    for i in range(rows)])
        for _ in range(4):
            batch.step([])
        batch.collect(everything=True)
        synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            batch.step([])
        batch.collect(everything=True)
        synchronize()
        per_step = (time.perf_counter() - start) / steps * 1e3
    times = {name: float(value) for name, value in (
        row.split(", ") for row in compile_times(repr="str", aggregate=True).splitlines()[2:] if ", " in row)}
    return {"first_batch_s": round(first, 2), "dynamo_s": round(times.get("_compile.compile_inner", 0.0), 2),
            "aot_s": round(times.get("create_aot_dispatcher_function", 0.0), 2),
            "graphs": counters["stats"]["unique_graphs"], "ms_per_step": round(per_step, 3)}


def _model(name: str):
    import torch

    if name.startswith("tiny:"):
        from transformers import AutoModelForCausalLM, LlamaConfig

        from devmap.generation.joined_projections import join_projections

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=int(name[5:]),
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        model = AutoModelForCausalLM.from_config(config).eval()
        join_projections(model)  # as the serving engine does
        return model
    import devmap
    from devmap.generation.joined_projections import join_projections

    model = devmap.load(name, device_map={"": 0}, dtype="bfloat16")
    join_projections(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--tiny", default="", help="depths of random tiny LLaMAs instead of --model, e.g. 4,16")
    parser.add_argument("--modes", default="regions,whole")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="run each once more with its inductor cache filled")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model|mode: the child process's run
    args = parser.parse_args()
    if args.one:
        name, mode = args.one.split("|")
        print(json.dumps(run_one(name, mode, args.backend, args.rows, args.steps)))
        return
    names = [f"tiny:{n}" for n in args.tiny.split(",")] if args.tiny else [args.model]
    print("| model | mode | start | first batch s | dynamo s | AOT s | graphs | ms per step |", flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in names:
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                for start in ("cold", "restart")[:2 if args.restart else 1]:
                    out = subprocess.run([sys.executable, __file__, "--one", f"{name}|{mode}", "--backend",
                                          args.backend, "--rows", str(args.rows), "--steps", str(args.steps)],
                                         env=env, capture_output=True, text=True)
                    if out.returncode:
                        print(f"| {name} | {mode} | {start} | failed: {out.stderr.strip().splitlines()[-1]} |")
                        continue
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"| {name} | {mode} | {start} | {r['first_batch_s']} | {r['dynamo_s']} | {r['aot_s']} | "
                          f"{r['graphs']} | {r['ms_per_step']} |", flush=True)


if __name__ == "__main__":
    main()
