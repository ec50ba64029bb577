"""Load a LLaMA-style checkpoint quantized (the seed notebook's `load_in_8bit=True, device_map="auto"`), generate, and
save it pre-quantized in the layout transformers' `from_pretrained` reads back.

Shows: `devmap.plan(..., quantization=...)` counting quantized bytes per device, `devmap.load(..., quantization=...)`
(torchao int8 here, which also runs on the CPU; "int4" and "nf4" or a BitsAndBytesConfig need GPUs),
`devmap.generate` through the lanes, `devmap.save(..., quantization=...)` and transformers reading that back.
Run: python examples/quantized_load_save.py [--preset llama-tiny --scheme int8 --out work]
"""

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import devmap

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="llama-tiny")
parser.add_argument("--scheme", default="int8", choices=["int8", "int4", "nf4"])
parser.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary folder)")
args = parser.parse_args()

work = Path(args.out or tempfile.mkdtemp(prefix="devmap-example-"))
devmap.save(args.preset, work / "bf16", dtype="bfloat16", overwrite=True)  # a full-precision checkpoint

device_map = "balanced" if torch.cuda.device_count() >= 2 else "cpu"
plan = devmap.plan(work / "bf16", device_map, quantization=args.scheme)
print(f"plan: {plan.total_bytes:,} bytes quantized to {args.scheme} instead of {plan.unquantized_bytes:,}")

model = devmap.load(work / "bf16", device_map, quantization=args.scheme)
prompt = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
out = devmap.generate(model, prompt.to(model.device), max_new_tokens=6)
print("greedy tokens:", out[:, prompt.shape[1]:].tolist())

saved = devmap.save(args.preset, work / args.scheme, weights=work / "bf16" / "model.safetensors",
                    quantization=args.scheme, device_map=device_map, overwrite=True)
print(f"saved {saved.num_tensors} tensors ({saved.total_bytes:,} bytes) to {saved.out_dir}")
theirs = AutoModelForCausalLM.from_pretrained(saved.out_dir, device_map=dict(model.hf_device_map))
with torch.no_grad():
    same = torch.equal(theirs(prompt.to(theirs.device)).logits, model(prompt.to(model.device)).logits)
print("transformers reads it back with the same logits:", same)
assert same
