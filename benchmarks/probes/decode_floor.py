"""How close one pipeline stage's decode step comes to reading its weights once: the floor of pipelined decoding.

Run on nvidia-h200 (one GPU):  PYTHONPATH=. python3 benchmarks/probes/decode_floor.py --model llama-2-70b --layers 40
A 2-GPU pipeline of llama-2-70b holds 40 blocks (~69 GB) per GPU. Decoding is bound by reading weights: each
lane-step of a stage reads the whole stage once. With L >= 2 lanes each GPU runs L lane-steps per token of
the batch; with 1 lane the two GPUs take turns: either way a token of the batch costs at least 2 stage reads
(a pipeline cannot beat it; tensor parallelism can). This script measures, on one GPU holding one stage:
  gemm    a CUDA graph of `x @ w.T` for every weight matrix of the stage at the decode batch: the weights read
          once, by the same cuBLAS kernels decode uses (its achieved bandwidth is the practical floor)
  devmap  devmap's decode step on the same stage (lanes 1, the rows of one lane), eager graphs and compiled,
          from the gaps between its streamed steps; and its prefill of the same rows
and prints the 2-GPU W4 (batch 32 = 2 lanes x 16, prompt 64, 32 new) that these imply, beside the
accelerate figure measured on 2 GPUs (RESULTS.md, W3 / W4), so the best reachable ratio is explicit.
"""

from __future__ import annotations

import argparse
import time

import torch

import devmap
from devmap.generation import forward, generate, timed
from devmap.planning import models


def gemm_floor(model: torch.nn.Module, rows: int, device: torch.device) -> tuple[float, int]:
    """Seconds of one replay of a graph that multiplies `rows` vectors by every 2-D weight once, and the bytes read."""
    weights = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    outputs = [torch.empty(rows, w.shape[0], device=device, dtype=w.dtype) for w in weights]

    def run() -> None:
        for w, out in zip(weights, outputs):
            torch.matmul(inputs[w.shape[1]], w.t(), out=out)

    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    seconds = min(timed(graph.replay)[1] for _ in range(5))
    return seconds, sum(w.numel() * w.element_size() for w in weights)


def step_seconds(model: torch.nn.Module, prompt: torch.Tensor, new: int, compile: bool) -> tuple[float, float]:
    """(seconds per decode step in steady state, whole call) from the times the steps' tokens are streamed."""
    stamps: list[float] = []

    def on_tokens(rows: slice, step: int, tokens: torch.Tensor) -> bool:
        stamps.append(time.perf_counter())
        return True

    call = lambda: generate(model, prompt, max_new_tokens=new, lanes=1, eos_token_id=[], compile=compile,  # noqa: E731
                            on_tokens=on_tokens)
    best_step, best_call = float("inf"), float("inf")
    for _ in range(3):  # the first call captures (and compiles)
        stamps.clear()
        _, seconds = timed(call)
        skip = len(stamps) // 4
        best_step = min(best_step, (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip))
        best_call = min(best_call, seconds)
    return best_step, best_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-70b")
    parser.add_argument("--layers", type=int, default=40, help="blocks on the one GPU: half of the model's")
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--accelerate-s", type=float, default=2.327,
                        help="accelerate's W4 on 2 GPUs for the whole model (RESULTS.md, W3 / W4, 70B)")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    preset = f"{args.model}-{args.layers}-blocks"
    models.LLAMA_PRESETS[preset] = {**models.LLAMA_PRESETS[args.model], "num_hidden_layers": args.layers}
    device = torch.device(args.device)
    model = devmap.load(preset, {"": args.device}, dtype="bf16")
    config = models.llama_config(preset)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, float] = {}
    with torch.no_grad():
        for rows in [int(r) for r in args.rows.split(",")]:
            prompt = torch.randint(0, config.vocab_size, (rows, 64), generator=generator).to(device)
            seconds, read = gemm_floor(model, rows, device)
            results[f"gemm {rows}"] = seconds
            print(f"rows {rows}: gemm floor {seconds * 1e3:.2f} ms ({read / 1e9:.1f} GB, "
                  f"{read / seconds / 1e12:.2f} TB/s)", flush=True)
            prefill = min(timed(lambda: forward(model, prompt, lanes=1))[1] for _ in range(3))
            results[f"prefill {rows}"] = prefill
            print(f"rows {rows}: prefill of {rows} x 64 {prefill * 1e3:.1f} ms", flush=True)
            for compile in ([False] if args.no_compile else [False, True]):
                step, call = step_seconds(model, prompt, args.new, compile)
                name = f"devmap{' compiled' if compile else ''} {rows}"
                results[name] = step
                print(f"rows {rows}: {name}: step {step * 1e3:.2f} ms ({read / step / 1e12:.2f} TB/s), "
                      f"call {call:.3f} s", flush=True)
                devmap.release_graphs(model)
    if "gemm 16" in results and "prefill 16" in results:
        print("\nW4 on 2 GPUs (2 lanes of 16 rows; prefill: 3 slots of a 2-stage, 2-lane pipeline; "
              f"{args.new - 1} decode tokens of 2 lane-steps per GPU), against accelerate's {args.accelerate_s} s:")
        for name in ("gemm 16", "devmap 16", "devmap compiled 16"):
            if name in results:
                estimate = 3 * results["prefill 16"] + (args.new - 1) * 2 * results[name]
                print(f"  at the {name} step: {estimate:.3f} s, {args.accelerate_s / estimate:.2f}x accelerate")


if __name__ == "__main__":
    main()
