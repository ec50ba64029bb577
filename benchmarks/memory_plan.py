"""Planned against measured memory: `devmap plan --for ...` beside `torch.cuda.max_memory_allocated` per device.

Run on one GPU (nvidia-h200 for 13B; each case in a fresh process, so every peak starts from nothing):
    PYTHONPATH=. python3 benchmarks/memory_plan.py --out $OUT
Cases (`--cases`, comma-separated):
  train:resnet50:BATCH:CHUNKS[:GRAPHS]  devmap.load(workload=train) + devmap.pipeline(chunks, graphs=GRAPHS: auto,
                                 off), or the placed model itself (eager), AdamW, 3 steps (fp32)
  generate:PRESET:BATCH:SEQ      devmap.load(workload=generate) + devmap.generate of BATCH prompts of SEQ-64 tokens,
                                 64 new (bf16, random weights, CUDA graphs kept as devmap keeps them)
  oversize:PRESET:ROWS:CACHE      a continuous batch of ROWS rows × CACHE tokens run though the serving plan would not
                                 admit it: its plan beside the GPU's memory, and whether it ran out of memory
  serve:PRESET:MAX_BATCH:PROMPT:NEW  the serving engine in-process (`devmap save` of random bf16 weights, loaded as
                                 `devmap serve --max-batch MAX_BATCH --max-prompt-tokens PROMPT --max-tokens NEW`
                                 plans it: as many rows as fit) and its largest batch: as many concurrent greedy
                                 requests as its rows, each with a PROMPT-token prompt and NEW tokens, twice
Reported per case and device: the plan's weights, KV cache, activations and other bytes, its total, the peak
`torch.cuda.max_memory_allocated` over the run (weights included), and measured ÷ planned. The target is
measured within 10% of planned; a plan above the measured peak wastes room, one below it would run out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
DEFAULT_CASES = ("train:resnet50:256:4:eager,train:resnet50:256:4:off,train:resnet50:256:4,"
                 "train:resnet50:1024:8:off,train:resnet50:1024:8,generate:tinyllama-1.1b:32:2048,"
                 "generate:llama-2-7b:32:2048,generate:llama-2-13b:32:2048,serve:tinyllama-1.1b:64:1984:64,"
                 "serve:llama-2-7b:128:1984:64")


def run_case(case: str) -> dict[str, Any]:
    """One case in this process: plan, load, run, and the plan beside the measured peak per GPU."""
    import torch

    import devmap
    from devmap.planning.models import resolve_source
    from devmap.planning.workload import parse_workload

    if case.startswith("serve:"):
        return _serve_case(case)
    if case.startswith("oversize:"):
        return _oversize_case(case)
    kind, source, batch, shape, *variant = case.split(":")
    batch, shape = int(batch), int(shape)
    graphs = variant[0] if variant else "auto"  # train: the pipeline's CUDA graphs ("auto", "off"; "eager": none)
    model_source = resolve_source(source)
    context = int(getattr(model_source.config, "max_position_embeddings", 0) or 0)
    if kind == "train":
        workload = parse_workload("train", causal_lm=False, batch=batch, input_shape=(3, 224, 224), chunks=shape,
                                  optimizer="adamw")
        dtype = None
    else:
        workload = parse_workload("generate", causal_lm=True, context=context, batch=batch, seq_len=shape)
        dtype = "bfloat16"
    started = time.perf_counter()
    model = devmap.load(source, device_map="auto", dtype=dtype, workload=workload)
    loaded = time.perf_counter() - started
    gpus = sorted({usage.key for usage in model.devmap_plan.devices.values() if isinstance(usage.key, int)})
    weights_now = {g: torch.cuda.memory_allocated(g) for g in gpus}
    for g in gpus:
        torch.cuda.reset_peak_memory_stats(g)
    failures: list[str] = []
    if kind == "train":
        failures = _train(model, workload, devmap, graphs)
    else:
        _generate(model, workload, devmap)
    rows = _measured(model.devmap_plan)
    for row in rows:
        row["weights_allocated"] = weights_now[int(row["device"].split(":")[1])]
    return {"case": case, "workload": workload.to_dict(), "load_seconds": loaded, "devices": rows,
            "graph_failures": failures,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def _measured(plan: Any) -> list[dict[str, Any]]:
    import torch

    rows = []
    for usage in plan.devices.values():
        if not isinstance(usage.key, int):
            continue
        torch.cuda.synchronize(usage.key)
        peak = torch.cuda.max_memory_allocated(usage.key)
        rows.append({"device": usage.device, "weights": usage.bytes, "kv_cache": usage.kv_cache_bytes,
                     "activations": usage.activation_bytes, "other": usage.other_bytes, "planned": usage.total,
                     "measured": peak, "reserved": torch.cuda.max_memory_reserved(usage.key),
                     "ratio": peak / usage.total})
    return rows


def _serve_case(case: str) -> dict[str, Any]:
    import asyncio
    import tempfile

    import torch

    import devmap
    from devmap.serving import Engine, EngineLimits, GenerationParams, ModelRegistry

    _, source, most, prompt, new = case.split(":")
    root = Path(tempfile.mkdtemp())
    devmap.save(source, root / "m", dtype="bfloat16")
    limits = EngineLimits(max_batch=int(most), max_prompt_tokens=int(prompt), max_new_tokens=int(new))
    registry = ModelRegistry(root, "auto", None, "bfloat16", limits=limits)
    engine = Engine(registry, limits)
    started = time.perf_counter()
    resident = registry.load(root / "m")
    loaded = time.perf_counter() - started
    for g in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(g)
    engine.start()
    vocab = resident.model.config.vocab_size
    params = GenerationParams(max_new_tokens=int(new), temperature=0)

    async def largest_batch() -> list[int]:
        prompts = [torch.randint(3, vocab, (int(prompt),)).tolist() for _ in range(resident.max_rows)]
        done = await asyncio.gather(*(engine.complete("m", ids, params) for ids in prompts))
        return [c.completion_tokens for c in done]

    try:
        tokens = [sum(asyncio.run(largest_batch())) for _ in range(2)]
    finally:
        engine.close(timeout=120)
    return {"case": case, "rows": resident.max_rows, "cache_len": resident.cache_len, "tokens": tokens,
            "batch_shape": list(resident.batch_shape.__dict__.values()), "load_seconds": loaded,
            "devices": _measured(resident.model.devmap_plan), "workload": resident.model.devmap_plan.workload.to_dict(),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def _oversize_case(case: str) -> dict[str, Any]:
    """A batch larger than the serving plan admits, run anyway: the plan for it beside the GPU, and whether it ran
    out of memory."""
    import torch

    import devmap
    from devmap.generation.continuous import SlotRequest, continuous_batch
    from devmap.planning.workload import parse_workload

    _, source, rows, cache = case.split(":")
    rows, cache = int(rows), int(cache)
    model = devmap.load(source, device_map={"": 0}, dtype="bfloat16")
    workload = parse_workload("serve", causal_lm=True, batch=rows, seq_len=cache, prefill_rows=4)
    planned = devmap.plan(source, {"": 0}, {0: "1000GiB"}, "bfloat16", workload=workload).devices["cuda:0"].total
    total = torch.cuda.get_device_properties(0).total_memory
    vocab = model.config.vocab_size
    requests = [SlotRequest(torch.randint(3, vocab, (cache - 128,)).tolist(), 64, i) for i in range(rows)]
    outcome = "ran"
    try:
        with continuous_batch(model, rows=rows, first_slot=cache - 128, cache_len=cache) as batch:
            batch.step(requests)
            for _ in range(8):
                batch.step([])
            batch.collect(everything=True)
    except torch.OutOfMemoryError:
        outcome = "out of memory"
    return {"case": case, "oversize": True, "planned": planned, "gpu_total": total, "outcome": outcome,
            "peak": torch.cuda.max_memory_allocated(0), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}


def _train(model: Any, workload: Any, devmap: Any, graphs: str) -> list[str]:
    """Three AdamW steps; the stages whose CUDA graphs failed to capture (they ran eagerly)."""
    import torch
    import torch.nn.functional as F

    model.train()
    pipe = model if graphs == "eager" else devmap.pipeline(model, chunks=workload.chunks, graphs=graphs)
    first = next(model.parameters()).device
    x = torch.randn(workload.batch, *workload.input_shape, device=first)
    labels = torch.randint(0, 1000, (workload.batch,), device=first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        out = pipe(x)
        F.cross_entropy(out, labels.to(out.device)).backward()
        optimizer.step()
    return list(getattr(pipe, "graph_failures", []))


def _generate(model: Any, workload: Any, devmap: Any) -> None:
    import torch

    new = 64
    ids = torch.randint(3, model.config.vocab_size, (workload.batch, workload.seq_len - new))
    devmap.generate(model, ids, max_new_tokens=new)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| case | device | weights | KV cache | activations | other | planned | measured peak | "
            "measured ÷ planned | reserved peak |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for result in results:
        if result.get("oversize"):
            lines.append(f"| {result['case']} | cuda:0 | planned {result['planned'] / GIB:.2f} GiB against the GPU's "
                         f"{result['gpu_total'] / GIB:.2f} GiB: {result['outcome']} | | | | | | | |")
            continue
        if "error" in result:
            lines.append(f"| {result['case']} | — | failed: {result['error']} | | | | | | | |")
            continue
        label = result["case"] + (f" ({result['rows']} rows × {result['cache_len']})" if "rows" in result else "")
        if result.get("graph_failures"):
            label += " (graphs failed: " + "; ".join(result["graph_failures"])[:80] + ")"
        for row in result["devices"]:
            lines.append(f"| {label} | {row['device']} | {row['weights'] / GIB:.2f} GiB | "
                         f"{row['kv_cache'] / GIB:.2f} GiB | {row['activations'] / GIB:.2f} GiB | "
                         f"{row['other'] / GIB:.2f} GiB | {row['planned'] / GIB:.2f} GiB | "
                         f"{row['measured'] / GIB:.2f} GiB | {row['ratio']:.3f} | {row['reserved'] / GIB:.2f} GiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case)), flush=True)
        return
    results = []
    for case in args.cases.split(","):
        child = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True)
        found = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if found:
            results.append(json.loads(found[-1]))
        else:
            last = (child.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"case": case, "error": last[:200]})
        print(table(results[-1:]).splitlines()[-1], flush=True)
    first = next((r for r in results if "gpu" in r), {})
    print(f"\n{first.get('gpu')}, torch {first.get('torch')}, transformers {first.get('transformers')}")
    print(table(results))
    if args.out:
        Path(args.out, "memory_plan.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
