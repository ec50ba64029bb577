"""W5: load a 7B-shaped LLaMA bf16 checkpoint onto 2 GPUs — devmap vs transformers vs accelerate, plus raw read speed.

Run on nvidia-h200-x2:  PYTHONPATH=. python benchmarks/load.py --out $OUT [--cold]
On a CPU (host memory, where devmap's tensors are views of the files):  ... --model tinyllama-1.1b --device-map cpu
With --cold, each system also runs as a fresh process (imports, then the load call, timed apart; the
devmap CLI is one of them), `--repeat` rounds with the systems interleaved. `devmap+tf-imports` is devmap
after the same top-of-script import a transformers script does, so that both calls start from equal imports.
Every system loads the same files (already in the page cache after a first read) in the same run; each
is timed until every GPU has synchronized, `--repeat` times, and the best and median are reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import cold_process


def raw_read(files: list[Path], block: int = 64 * 2**20) -> float:
    """Seconds for a plain Python read loop over the files (64 MiB read() calls)."""
    start = time.perf_counter()
    buf = bytearray(block)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - start


def sync_all() -> None:
    for g in range(torch.cuda.device_count()):
        torch.cuda.synchronize(g)


def free(model) -> None:  # type: ignore[no-untyped-def]
    del model
    gc.collect()
    torch.cuda.empty_cache()


def load_devmap(path: Path, strategy: str):  # type: ignore[no-untyped-def]
    import devmap

    return devmap.load(str(path), strategy, dtype="bf16")


def load_transformers(path: Path, strategy: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), device_map=strategy, dtype=torch.bfloat16)


def load_accelerate(path: Path, strategy: str):  # type: ignore[no-untyped-def]
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.tie_weights()
    return load_checkpoint_and_dispatch(model, str(path), device_map=strategy, dtype=torch.bfloat16,
                                        no_split_module_classes=["LlamaDecoderLayer"])


SYSTEMS = {"devmap": load_devmap, "transformers": load_transformers, "accelerate": load_accelerate}

# A cold load is a fresh process: each system's imports, then its load call, then both GPUs synchronized.
COLD_SCRIPT = """
import json, sys, time
start = time.perf_counter()
import torch
sys.path.insert(0, {bench!r})
import load as bench
system, path, strategy = sys.argv[1], sys.argv[2], sys.argv[3]
if system != "devmap":  # what a transformers script imports at its top ("devmap+tf-imports": the same, then devmap)
    from transformers import AutoModelForCausalLM
imported = time.perf_counter()
model = bench.SYSTEMS[system.removesuffix("+tf-imports")](bench.Path(path), strategy)
bench.sync_all()
done = time.perf_counter()
print(json.dumps({{"imports_s": imported - start, "call_s": done - imported, "start_to_weights_s": done - start}}))
"""


def run_cold(path: Path, strategy: str, systems: list[str], rounds: int) -> dict[str, list[dict[str, float]]]:
    """Each system `rounds` times as a fresh process, rounds interleaved; the devmap CLI is one of the systems."""
    import sys

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    script = COLD_SCRIPT.format(bench=str(Path(__file__).resolve().parent))
    for _ in range(rounds):
        for name in systems:
            if name == "devmap-cli":
                command = [sys.executable, "-m", "devmap", "load", str(path), "--device-map", strategy, "--dtype",
                           "bf16", "--json"]
            else:
                command = [sys.executable, "-c", script, name, str(path), strategy]
            row = cold_process(command, name)
            runs[name].append(row)
            print(f"cold {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return runs


def print_cold(runs: dict[str, list[dict[str, float]]]) -> list[dict]:
    rows = []
    reference = {k: min(r[k] for r in runs["transformers"]) for k in ("call_s", "process_s")} \
        if "transformers" in runs else None
    print(f"\n{'cold system':<16}{'imports s':>10}{'call s':>9}{'process s':>11}"
          f"{'call time / tf':>15}{'process / tf':>14}")
    for name, values in runs.items():
        best = {k: min(r[k] for r in values if k in r) for k in ("imports_s", "call_s", "process_s") if k in values[0]}
        ratio = {k: best[k] / reference[k] for k in ("call_s", "process_s")} if reference else {}
        rows.append({"system": name, **{f"best_{k}": v for k, v in best.items()},
                     **{f"{k}_vs_transformers": v for k, v in ratio.items()}})
        imports = f"{best['imports_s']:.2f}" if "imports_s" in best else "-"
        print(f"{name:<16}{imports:>10}{best['call_s']:>9.2f}{best['process_s']:>11.2f}"
              f"{ratio.get('call_s', 0):>14.2f}x{ratio.get('process_s', 0):>13.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--dir", default="/tmp/devmap-bench/llama-2-7b")
    parser.add_argument("--device-map", default="balanced")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--systems", default="devmap,transformers,accelerate")
    parser.add_argument("--out", default=None, help="folder for results.json")
    parser.add_argument("--cold", action="store_true", help="also time each system as a fresh process")
    parser.add_argument("--cold-systems", default="devmap,transformers,devmap-cli")
    args = parser.parse_args()
    path = Path(args.dir)
    if not (path / "config.json").exists():
        from devmap.loading.saver import save

        t = time.perf_counter()
        save(args.model, path, dtype="bfloat16", max_shard_size="5GB", seed=0)
        print(f"wrote {args.model} to {path} in {time.perf_counter() - t:.1f} s", flush=True)
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    raw_read(files)  # bring the files into the page cache
    raw = min(raw_read(files) for _ in range(2))
    times: dict[str, list[float]] = {name: [] for name in args.systems.split(",")}
    memory: dict[str, dict[str, int]] = {}
    for _ in range(args.repeat):
        for name in times:
            sync_all()
            before = {g: torch.cuda.memory_allocated(g) for g in range(torch.cuda.device_count())}
            start = time.perf_counter()
            model = SYSTEMS[name](path, args.device_map)
            sync_all()
            times[name].append(time.perf_counter() - start)
            memory[name] = {f"cuda:{g}": torch.cuda.memory_allocated(g) - before[g] for g in before}
            print(f"{name}: {times[name][-1]:.2f} s  {memory[name]}", flush=True)
            free(model)
    best_baseline = min(min(v) for k, v in times.items() if k != "devmap") if len(times) > 1 else None
    rows = []
    for name, values in times.items():
        best = min(values)
        rows.append({"system": name, "best_s": best, "median_s": statistics.median(values),
                     "gb_per_s": size / best / 1e9, "per_gpu_bytes": memory[name],
                     "speedup_vs_faster_baseline": best_baseline / best if best_baseline else None})
    print(f"\nW5 load: {args.model} bf16, {size / 1e9:.2f} GB in {len(files)} shards, device_map={args.device_map}, "
          f"torch {torch.__version__}, " + (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
                                             if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"))
    print(f"raw read loop (64 MiB read() calls, page cache): {raw:.2f} s = {size / raw / 1e9:.1f} GB/s")
    print(f"{'system':<14}{'best s':>8}{'median s':>10}{'GB/s':>8}{'vs faster baseline':>20}")
    for r in rows:
        ratio = f"{r['speedup_vs_faster_baseline']:.2f}x" if r["speedup_vs_faster_baseline"] else "-"
        print(f"{r['system']:<14}{r['best_s']:>8.2f}{r['median_s']:>10.2f}{r['gb_per_s']:>8.1f}{ratio:>20}")
    cold_rows = None
    if args.cold:
        cold_rows = print_cold(run_cold(path, args.device_map, args.cold_systems.split(","), args.repeat))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "load_results.json").write_text(json.dumps(
            {"rows": rows, "cold": cold_rows, "raw_read_s": raw, "bytes": size, "times": times}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
