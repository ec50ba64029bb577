"""Save a LLaMA-style checkpoint to a local directory, load it with `balanced` (and once with disk offload), generate.

Shows: `devmap.save` (no hub: a preset with seeded random weights, sharded like save_pretrained),
`devmap.load` from a local path straight onto its devices, offload to disk with `offload_folder`, and
`devmap.generate` (greedy, lanes flowing through the stages).
Run: python examples/llama_save_load_generate.py [--preset llama-tiny --out ckpt]
"""

import argparse
import tempfile
from pathlib import Path

import torch

import devmap

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="llama-tiny")
parser.add_argument("--out", default=None, help="where to write the checkpoint (default: a temporary folder)")
args = parser.parse_args()

work = Path(args.out or tempfile.mkdtemp(prefix="devmap-example-"))
saved = devmap.save(args.preset, work / "model", max_shard_size="300KB", overwrite=True)
print(f"saved {saved.num_tensors} tensors in {len(saved.files)} files to {saved.out_dir}")

gpus = torch.cuda.device_count()
memory = {i: "20GiB" for i in range(gpus)} if gpus >= 2 else {"cpu": "1GiB"}
model = devmap.load(work / "model", "balanced", max_memory=memory)
print("placed:", {k: v for k, v in list(model.hf_device_map.items())[:4]}, "…")

prompts = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
tokens = devmap.generate(model, prompts, max_new_tokens=8)
print("new tokens of row 0:", tokens[0, 16:].tolist())

# The same checkpoint with only 400 KB of host memory allowed: the rest is offloaded to disk.
offloaded = devmap.load(work / "model", max_memory={"cpu": "400KB"}, offload_folder=work / "offload")
print("offloaded to disk:", [name for name, device in offloaded.hf_device_map.items() if device == "disk"][:3], "…")
with torch.no_grad():
    same = torch.allclose(offloaded(prompts).logits, model(prompts.to(model.device)).logits.cpu(), atol=1e-4)
print("disk-offloaded logits equal the in-memory model's:", same)
assert same
