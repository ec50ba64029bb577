"""Tensor parallelism on W3 and W4, one process per GPU: the systems `llama_inference.py` runs under torchrun.

Run by llama_inference.py as `torchrun --nproc-per-node N benchmarks/llama_tp.py CHECKPOINT OUT.json ROUNDS SYSTEM`
(the checkpoint is the same random model the other systems run, saved by it). SYSTEM is `transformers`
(`tp_plan="auto"`: W3 its eager forward, W4 generate with its static cache and auto-compiled decode step), `devmap`
(`devmap.load(..., tensor_parallel=N)`: W3 `devmap.generation.forward`, W4 `devmap.generate` with its CUDA graphs)
or `devmap-compiled` (the same, its steps through torch.compile inside the graphs). Every rank runs the same calls on
the same inputs; rank 0 writes the seconds of each call, the first (compiling, capturing) call kept.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"  [tp] {message}", flush=True)


def timed(fn, rounds: int) -> list[float]:  # type: ignore[no-untyped-def]
    seconds = []
    for _ in range(rounds):
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        seconds.append(time.perf_counter() - start)
        say(f"call {len(seconds)}: {seconds[-1]:.3f} s")
    return seconds


def main() -> None:
    checkpoint, out = sys.argv[1], Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    system = sys.argv[4] if len(sys.argv) > 4 else "transformers"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before any collective: one GPU per rank
    faulthandler.dump_traceback_later(float(os.environ.get("DEVMAP_TP_STACKS_AFTER", "600")))  # where a rank hangs
    start = time.perf_counter()
    if system == "transformers":
        from transformers import DistributedConfig  # a tp_plan= keyword is deprecated since 5.17

        model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_plan="auto"),
                                                     dtype=torch.bfloat16).eval()
    else:
        import devmap

        model = devmap.load(checkpoint, tensor_parallel=int(os.environ["WORLD_SIZE"]), dtype="bf16")
    device = next(model.parameters()).device
    say(f"{system}: loaded in {time.perf_counter() - start:.1f} s on {device}")
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prefill = torch.randint(0, vocab, (32, 512), generator=generator).to(device)
    prompt = torch.randint(0, vocab, (32, 64), generator=generator).to(device)
    with torch.no_grad():
        if system == "transformers":
            w3 = timed(lambda: model(prefill), rounds)
            w4 = timed(lambda: model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                              pad_token_id=0, cache_implementation="static"), rounds)
        else:
            from devmap.generation import forward, generate

            compile = system == "devmap-compiled"
            w3 = timed(lambda: forward(model, prefill, lanes=1, compile=compile), rounds)
            w4 = timed(lambda: generate(model, prompt, max_new_tokens=32, eos_token_id=[], compile=compile), rounds)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"W3": w3, "W4": w4}))
    dist.barrier(device_ids=[torch.cuda.current_device()])
    sys.stdout.flush()
    # no destroy_process_group (after CUDA graphs captured NCCL collectives it can hang, pytorch#115388) and no normal
    # exit (inductor's compile workers kept the ranks alive past the store's shutdown)
    os._exit(0)


if __name__ == "__main__":
    main()
