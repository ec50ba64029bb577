"""Repeat the two-GPU generate test's calls and say which rows differ from transformers' greedy tokens (a probe).

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/generate_race_probe.py
                   and  CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python3 benchmarks/probes/generate_race_probe.py
The tiny fp32 LLaMA of tests/generation/test_gpu_generation.py, split over two GPUs; the same batch of 8 prompts
(left-padded) and two others of that shape, through devmap.generate with cached graphs, graphs released before each
call, keep_graphs=False, graphs=False and 1 or 2 lanes. Each line: OK, or the rows that differ and the first column
where they do. Before the fix of the hand-off copy, rows 6 and 7 (the last of 3 lanes) differed in many calls, every
failing call one with 3 lanes and CUDA graphs, while transformers' own tokens were the same from run to run, and
everything was OK with CUDA_LAUNCH_BLOCKING=1: a stream ordering race on the two-GPU path, not a numerical difference.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import devmap
from devmap import generate

sys.path.insert(0, "tests/generation")
from test_gpu_generation import CONFIG, left_padded, two_gpu_copy  # noqa: E402


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).to("cuda:0").eval()
    placed = two_gpu_copy(reference)
    ids, mask = left_padded(8, 12, 5, 3)

    def ref(i: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return reference.generate(i, attention_mask=m, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                  eos_token_id=None).cpu()

    def report(tag: str, got: torch.Tensor, want: torch.Tensor) -> None:
        bad = [(r, int((got[r] != want[r]).nonzero()[0])) for r in range(got.shape[0])
               if not torch.equal(got[r], want[r])]
        print(tag, "OK" if not bad else f"rows differ (row, first column): {bad}", flush=True)

    def other(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.randint(3, 1000, ids.shape, generator=torch.Generator().manual_seed(seed)).to("cuda:0")
        om = torch.ones_like(o)
        om[seed, :seed] = 0
        return o.masked_fill(om == 0, 0), om

    print("transformers' tokens the same twice:", torch.equal(ref(ids, mask), ref(ids, mask)), flush=True)
    base = dict(max_new_tokens=20, lanes=3, eos_token_id=[], pad_token_id=0)
    for variant in ("cached", "released-before-each", "keep_graphs=False", "graphs=False", "lanes=1", "lanes=2"):
        devmap.release_graphs(placed)
        report(f"{variant} first batch", generate(placed, ids, mask, **base), ref(ids, mask))
        for seed in (2, 3, 2):
            o, om = other(seed)
            kwargs = dict(base)
            if variant == "released-before-each":
                devmap.release_graphs(placed)
            if variant == "keep_graphs=False":
                kwargs["keep_graphs"] = False
            if variant == "graphs=False":
                kwargs["graphs"] = False
            if variant.startswith("lanes="):
                kwargs["lanes"] = int(variant[-1])
            report(f"{variant} other batch {seed}", generate(placed, o, om, **kwargs), ref(o, om))
        report(f"{variant} first batch again", generate(placed, ids, mask, **base), ref(ids, mask))


if __name__ == "__main__":
    main()
