"""Where a continuous batch's memory goes beyond its KV cache: allocated bytes after each part of its setup.

Run on one GPU: PYTHONPATH=. python3 benchmarks/probes/serve_memory.py --model tinyllama-1.1b --rows 64 \
    --first-slot 1984 --cache-len 2048
Prints, in MiB: the weights; the lanes' caches and decode steps; each joining pack width's captured prefill
(static buffers and pool); the whole setup against rows × cache KV; the peak.
"""

from __future__ import annotations

import argparse

import torch

import devmap
from devmap.generation import join_prefill
from devmap.generation.continuous import continuous_batch
from devmap.planning.runtime_memory import layer_kv_bytes

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--first-slot", type=int, default=1984)
    parser.add_argument("--cache-len", type=int, default=2048)
    args = parser.parse_args()
    model = devmap.load(args.model, device_map={"": 0}, dtype="bfloat16")
    weights = torch.cuda.memory_allocated(0)
    print(f"weights {weights / MIB:.0f} MiB")
    torch.cuda.reset_peak_memory_stats(0)
    shapes: list[tuple[int, int, int]] = []
    original = join_prefill.JoinPrefills._through_stages

    def recording(self, group, width, *rest, **kwargs):  # type: ignore[no-untyped-def]
        before = torch.cuda.memory_allocated(0)
        out = original(self, group, width, *rest, **kwargs)
        shapes.append((group, width, torch.cuda.memory_allocated(0) - before))
        return out

    join_prefill.JoinPrefills._through_stages = recording
    config = model.config
    kv = config.num_hidden_layers * layer_kv_bytes(config, torch.bfloat16, args.rows, args.cache_len)
    with continuous_batch(model, rows=args.rows, first_slot=args.first_slot, cache_len=args.cache_len):
        setup = torch.cuda.memory_allocated(0) - weights
        peak = torch.cuda.max_memory_allocated(0) - weights
    by_shape = {}
    for group, width, size in shapes:
        by_shape[(group, width)] = by_shape.get((group, width), 0) + size
    for (group, width), size in sorted(by_shape.items(), key=lambda item: -item[1])[:12]:
        print(f"  join {group} × {width}: {size / MIB:.1f} MiB kept")
    print(f"join shapes captured: {len(by_shape)}, kept by them in all: {sum(by_shape.values()) / MIB:.0f} MiB")
    print(f"setup {setup / MIB:.0f} MiB (rows × cache KV {kv / MIB:.0f} MiB, beyond it {(setup - kv) / MIB:.0f} MiB); "
          f"peak beyond the weights {peak / MIB:.0f} MiB; reserved {torch.cuda.memory_reserved(0) / MIB:.0f} MiB")


if __name__ == "__main__":
    main()
