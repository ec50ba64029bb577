"""Quantized loading and W4 generation, devmap vs transformers `from_pretrained(quantization_config=...)`.

Run on nvidia-h200-x2 (torchao and bitsandbytes travel as wheels):
    PYTHONPATH=/tmp/site:. python3 benchmarks/quantized.py --model llama-2-7b --out $OUT
For each scheme (int8 and int4: torchao; nf4: bitsandbytes) both systems load the same bf16 checkpoint (random
weights, written once by devmap's saver, in the page cache) with `device_map="balanced"` over 2 GPUs, the peer
with the same library and layout (`devmap.loading.quantize.transformers_config`):
  warm   in this process, `--repeat` rounds after an untimed first one (whichever system goes first there pays
         the libraries' one-time CUDA set-up), systems interleaved, each until both GPUs synchronize
  cold   a fresh process per load (imports, then the call; the devmap CLI is one of the systems)
  W4     greedy, batch 32, prompt 64, 32 new tokens (no early stop): transformers' generate with its dynamic
         cache and with its static cache (auto-compiled decode), devmap.generate through its lanes, with CUDA
         graphs of the eager layers and with torch.compile'd steps (compile=True)
Steady state is the best call after the first; the first call is reported beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from common import cold_process

SCHEMES = ("int8", "int4", "nf4")
COLD_SCRIPT = """
import json, sys, time
start = time.perf_counter()
import torch
system, path, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
if system == "devmap":
    import devmap
else:
    from transformers import AutoModelForCausalLM
    from devmap.loading.quantize import transformers_config
    from devmap.planning.quantization import parse_quantization
imported = time.perf_counter()
if system == "devmap":
    model = devmap.load(path, "balanced", quantization=scheme)
else:
    config = transformers_config(parse_quantization(scheme), torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="balanced",
                                                 dtype=torch.bfloat16)
for g in range(torch.cuda.device_count()):
    torch.cuda.synchronize(g)
done = time.perf_counter()
print(json.dumps({"imports_s": imported - start, "call_s": done - imported}))
"""


def sync_all() -> None:
    for g in range(torch.cuda.device_count()):
        torch.cuda.synchronize(g)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync_all()
    start = time.perf_counter()
    out = fn()
    sync_all()
    return out, time.perf_counter() - start


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def load_devmap(path: Path, scheme: str) -> Any:
    import devmap

    return devmap.load(str(path), "balanced", quantization=scheme)


def load_transformers(path: Path, scheme: str) -> Any:
    from transformers import AutoModelForCausalLM

    from devmap.loading.quantize import transformers_config
    from devmap.planning.quantization import parse_quantization

    config = transformers_config(parse_quantization(scheme), torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(str(path), quantization_config=config, device_map="balanced",
                                                dtype=torch.bfloat16)


LOADERS = {"devmap": load_devmap, "transformers": load_transformers}


def warm_loads(path: Path, scheme: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in LOADERS}
    for _ in range(rounds + 1):
        for name, loader in LOADERS.items():
            model, seconds = timed(lambda: loader(path, scheme))  # noqa: B023
            times[name].append(seconds)
            used = [torch.cuda.memory_allocated(g) / 2**30 for g in range(torch.cuda.device_count())]
            print(f"  warm {scheme} {name}: {seconds:.2f} s, GPUs hold {', '.join(f'{u:.2f}' for u in used)} GiB",
                  flush=True)
            del model
            free()
    return times


def cold_loads(path: Path, scheme: str, rounds: int) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {"devmap": [], "transformers": [], "devmap-cli": []}
    for _ in range(rounds):
        for name in runs:
            if name == "devmap-cli":
                command = [sys.executable, "-m", "devmap", "load", str(path), "--device-map", "balanced",
                           "--quantize", scheme, "--json"]
            else:
                command = [sys.executable, "-c", COLD_SCRIPT, name, str(path), scheme]
            row = cold_process(command, f"{name} {scheme}")
            runs[name].append(row)
            print(f"  cold {scheme} {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return runs


def generation(path: Path, scheme: str, repeat: int, lanes: list[int], static: bool,
               compiled: bool) -> dict[str, list[float]]:
    """W4 calls (first included) per system."""
    import devmap
    from devmap.planning.models import llama_config  # noqa: F401 (devmap's import of transformers, shared)

    calls: dict[str, list[float]] = {}
    prompt = torch.randint(3, 30000, (32, 64), generator=torch.Generator().manual_seed(0)).to("cuda:0")

    def measure(label: str, fn: Callable[[], Any]) -> None:
        try:
            calls[label] = [timed(fn)[1] for _ in range(repeat + 1)]
        except Exception as error:  # a peer configuration that fails is reported, not fatal
            print(f"  W4 {scheme} {label}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                  flush=True)
            return
        print(f"  W4 {scheme} {label}: first {calls[label][0]:.3f} s, best {min(calls[label][1:]):.3f} s",
              flush=True)

    with torch.no_grad():
        model = load_transformers(path, scheme)
        hf = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        measure("transformers, dynamic cache", lambda: model.generate(prompt, **hf))
        if static:
            measure("transformers, static cache (compiled)",
                    lambda: model.generate(prompt, cache_implementation="static", **hf))
        model = None
        free()
        torch._dynamo.reset()
        model = load_devmap(path, scheme)
        for compile in (False, True) if compiled else (False,):
            for n in lanes:
                measure(f"devmap (lanes {n}{', compiled' if compile else ''})",
                        lambda: devmap.generate(model, prompt, max_new_tokens=32, lanes=n,  # noqa: B023
                                                eos_token_id=[], compile=compile))  # noqa: B023
            devmap.release_graphs(model)
        model = None
        free()
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default /tmp/devmap-bench/MODEL)")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--repeat", type=int, default=2, help="warm load rounds and W4 calls after the first")
    parser.add_argument("--cold-rounds", type=int, default=1)
    parser.add_argument("--lanes", default="2")
    parser.add_argument("--no-static", action="store_true", help="skip transformers' static cache (compiles)")
    parser.add_argument("--no-compile", action="store_true", help="skip devmap's compile=True steps")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = Path(args.dir or f"/tmp/devmap-bench/{args.model}")
    if not (path / "config.json").exists():
        from devmap.loading.saver import save

        start = time.perf_counter()
        save(args.model, path, dtype="bfloat16", max_shard_size="5GB", seed=0)
        print(f"wrote {args.model} to {path} in {time.perf_counter() - start:.1f} s", flush=True)
    for f in sorted(path.glob("*.safetensors")):  # into the page cache
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 * 2**20):
                pass
    results: dict[str, Any] = {}
    for scheme in args.schemes.split(","):
        warm = warm_loads(path, scheme, args.repeat)
        cold = cold_loads(path, scheme, args.cold_rounds) if args.cold_rounds else {}
        w4 = {} if args.skip_generate else generation(path, scheme, args.repeat, [int(x) for x in
                                                                                 args.lanes.split(",")],
                                                      not args.no_static, not args.no_compile)
        results[scheme] = {"warm": warm, "cold": cold, "w4": w4}
    report(args.model, results)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"quantized_{args.model}.json").write_text(json.dumps(results, indent=2))


def report(model: str, results: dict[str, Any]) -> None:
    import transformers

    print(f"\n{model}, bf16 checkpoint, device_map=balanced over {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers {transformers.__version__}")
    print("| scheme | load | devmap s | transformers s | transformers ÷ devmap |\n|---|---|---|---|---|")
    for scheme, r in results.items():
        warm = {k: min(v[1:] or v) for k, v in r["warm"].items()}
        print(f"| {scheme} | warm (best after the first) | {warm['devmap']:.2f} | {warm['transformers']:.2f} | "
              f"**{warm['transformers'] / warm['devmap']:.2f}×** |")
        if r["cold"]:
            best = {k: {m: min(x[m] for x in v) for m in v[0]} for k, v in r["cold"].items()}
            d, t, c = best["devmap"], best["transformers"], best["devmap-cli"]
            print(f"| {scheme} | cold call (after imports) | {d['call_s']:.2f} | {t['call_s']:.2f} | "
                  f"{t['call_s'] / d['call_s']:.2f}× |")
            print(f"| {scheme} | cold process (library) | {d['process_s']:.2f} | {t['process_s']:.2f} | "
                  f"{t['process_s'] / d['process_s']:.2f}× |")
            print(f"| {scheme} | cold process (`devmap load` CLI) | {c['process_s']:.2f} | {t['process_s']:.2f} | "
                  f"{t['process_s'] / c['process_s']:.2f}× |")
    print("\n| scheme | W4 system | steady s | tokens/s | first call s | vs best transformers |\n"
          "|---|---|---|---|---|---|")
    for scheme, r in results.items():
        steady = {k: min(v[1:]) for k, v in r["w4"].items()}
        best_tf = min((v for k, v in steady.items() if k.startswith("transformers")), default=None)
        for name, seconds in steady.items():
            ratio = f"{best_tf / seconds:.2f}×" if best_tf else "-"
            print(f"| {scheme} | {name} | {seconds:.3f} | {32 * 32 / seconds:,.0f} | {r['w4'][name][0]:.2f} | "
                  f"{ratio} |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
