"""Fresh-process times of devmap's commands that answer from a config alone, against accelerate's plan of a model.

Run on any machine (CI's size: 2 cores, no GPU):  PYTHONPATH=. python3 benchmarks/cli_start.py --out $OUT
Each command runs as a new process, `--rounds` times with the commands interleaved; the table gives the median and
the least wall time of each, from the process's start to its end. The peer is what accelerate's documentation has a
user run to plan a model: transformers' config, the model built under `init_empty_weights`, then
`infer_auto_device_map` over the same simulated GPUs. `import torch` alone is the floor every command pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER = """
import sys
from accelerate import infer_auto_device_map, init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
with init_empty_weights():
    model = AutoModelForCausalLM.from_config(config)
budget = {0: "8GiB", 1: "8GiB", "cpu": "64GiB"}
print(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=list(model._no_split_modules)))
"""


def commands(config_dir: Path) -> dict[str, list[str]]:
    devmap = [sys.executable, "-m", "devmap"]
    gpus = ["--gpus", "2", "--gpu-memory", "8GiB"]
    return {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "devmap --help": [*devmap, "--help"],
        "devmap env --json": [*devmap, "env", "--json"],
        "devmap plan llama-tiny": [*devmap, "plan", "llama-tiny"],
        "devmap plan DIR (7B config)": [*devmap, "plan", str(config_dir), *gpus],
        "accelerate: infer_auto_device_map of DIR": [sys.executable, "-c", PEER, str(config_dir)],
    }


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed: {done.stderr.strip()[-1000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/tmp/devmap-bench/llama-2-7b-config", help="a config-only 7B directory")
    parser.add_argument("--out", default=None, help="folder for cli_start.json")
    args = parser.parse_args()
    config_dir = Path(args.dir)
    if not (config_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "devmap", "save", "llama-2-7b", str(config_dir), "--config-only"],
                       check=True, capture_output=True)
    runs = commands(config_dir)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, command in runs.items():  # an untimed first round: the files in the page cache, .pyc written
        timed(command)
    for _ in range(args.rounds):
        for name, command in runs.items():
            times[name].append(timed(command))
    import accelerate
    import torch
    import transformers

    peer = statistics.median(times["accelerate: infer_auto_device_map of DIR"])
    print(f"fresh processes, {args.rounds} rounds · {platform.node()} ({os.cpu_count()} cores) · "
          f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")
    print("\n| command | median s | least s | median ÷ accelerate's plan |\n|---|---|---|---|")
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"command": name, "median_s": median, "least_s": min(values), "vs_peer": median / peer})
        print(f"| {name} | {median:.2f} | {min(values):.2f} | {median / peer:.2f}× |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cli_start.json").write_text(json.dumps({"rows": rows, "times": times}, indent=2))


if __name__ == "__main__":
    main()
