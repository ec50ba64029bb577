"""Pipelined forward and generate over two GPUs that other processes keep busy, against transformers (a probe).

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/busy_gpus_probe.py [--seconds 90]
Two processes multiply big matrices on both GPUs the whole time (the GPUs time-slice between processes, so each of
devmap's streams runs late by a different amount: what a shared machine or pytest-xdist does), while one process per
variant repeats a call of the tiny fp32 LLaMA of tests/generation/test_gpu_generation.py against transformers: three
calls (eager, captured, replayed) after each `release_graphs`. Variants: `forward` (6 rows, 3 lanes over 2 stages),
`eager` (graphs off), `no-front-head` (the head's rows all on the last stage), `one-gpu` (both stages on GPU 0),
`generate` (16 greedy tokens, 2 lanes) and `served` (the served-lanes test's requests, 24 at once and 24 joining, to
the tiny preset with a tied head over both GPUs, both ways of joining, against `devmap.generate` of each alone). Each
line: calls with a row off, and which (call of three, rows) they were (`served`: requests answered otherwise).
A buffer's zeros queued on a stage's stream and a hand-off that did not wait for them gave every wrong call here
(the first of three: where the buffers are made), on two GPUs only, with graphs on.
"""

from __future__ import annotations

import argparse
import collections
import copy
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap import generate, release_graphs
from devmap.generation import forward, lane_prefill

sys.path.insert(0, "tests/generation")
from test_gpu_generation import CONFIG, left_padded, two_gpu_copy  # noqa: E402

VARIANTS = ("forward", "eager", "no-front-head", "one-gpu", "generate", "served")


def busy(seconds: float) -> None:
    """Big products on every GPU until `seconds` have passed."""
    end = time.time() + seconds
    mats = [torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(torch.cuda.device_count())]
    while time.time() < end:
        for m in mats:
            with torch.cuda.device(m.device):
                for _ in range(4):
                    m @ m
        torch.cuda.synchronize()


def served(seconds: float) -> str:
    """The served-lanes test's crowd of requests, repeated: how many were answered otherwise than alone."""
    import itertools
    import tempfile
    from pathlib import Path

    import devmap
    from devmap.serving import EngineLimits, ModelRegistry

    sys.path.insert(0, "tests/serving")
    from lane_checks import served_and_alone

    torch.backends.cuda.matmul.allow_tf32 = False
    root = Path(tempfile.mkdtemp(prefix="devmap-probe-"))
    devmap.save("llama-tiny", root / "tiny")
    answered, wrong = 0, collections.Counter()
    end = time.time() + seconds
    for riding in itertools.cycle([False, True]):
        if time.time() > end:
            break
        limits = EngineLimits(max_batch=4, compile=False, riding=riding)
        registry = ModelRegistry(root, "balanced", {0: "8GiB", 1: "8GiB"}, limits=limits)
        registry.load(root / "tiny")
        for got, alone in served_and_alone(registry, limits, "tiny", 24):
            answered += 1
            wrong["riding" if riding else "own prefills"] += got != alone
        registry.unload("tiny")
    return f"served: {sum(wrong.values())} of {answered} requests answered otherwise; {dict(wrong)}"


def probe(variant: str, seconds: float) -> str:
    if variant == "served":
        return served(seconds)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).to("cuda:0").eval()
    split = None
    if variant == "one-gpu":
        placed, split = copy.deepcopy(reference), [CONFIG["num_hidden_layers"] // 2]
    else:
        placed = two_gpu_copy(reference)
    ids, mask = left_padded(6, 16, 2, 4)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits.float()
        tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                                    eos_token_id=None).cpu()
    if variant == "no-front-head":
        lane_prefill.LanePrefill.front_head = lambda self, out: None
    calls, wrong = 0, collections.Counter()
    end = time.time() + seconds
    while time.time() < end:
        for call in range(3):  # eager, captured, replayed
            if variant == "generate":
                got = generate(placed, ids, mask, max_new_tokens=16, lanes=2, eos_token_id=[])
                rows = (got != tokens).any(dim=1).nonzero().flatten().tolist()
            else:
                logits = forward(placed, ids, mask, lanes=3, graphs=variant != "eager", split_layers=split)
                off = (logits.float().to("cuda:0") - expected).abs() > 1e-3
                rows = off.flatten(1).any(dim=1).nonzero().flatten().tolist()
            calls += 1
            if rows:
                wrong[(call, tuple(rows))] += 1
        release_graphs(placed)
    return f"{variant}: {sum(wrong.values())} of {calls} calls with a row off; (call, rows): {dict(wrong)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--variant", choices=VARIANTS + ("busy",), help="one worker (the probe starts them all)")
    args = parser.parse_args()
    if args.variant == "busy":
        busy(args.seconds + 30)
    elif args.variant:
        print(probe(args.variant, args.seconds), flush=True)
    else:
        command = [sys.executable, __file__, "--seconds", str(args.seconds), "--variant"]
        loads = [subprocess.Popen(command + ["busy"]) for _ in range(2)]
        workers = [subprocess.Popen(command + [v], stdout=subprocess.PIPE, text=True) for v in VARIANTS]
        for worker in workers:
            print(worker.communicate()[0].strip(), flush=True)
        for load in loads:
            load.kill()


if __name__ == "__main__":
    main()
