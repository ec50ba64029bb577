"""The serving benchmarks run end to end on the CPU (`benchmarks/serve.py --cpu-check`: a whole model and one split
over two gloo processes, their clients, tables and JSON; `benchmarks/serve_load.py --cpu-check`: a second model
loaded over HTTP beside a first one's streams), so that a GPU run does not find its script broken."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_serving_benchmark_runs_on_the_cpu(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model", "llama-tiny", "--cpu-check",
               "--clients", "2", "--seconds", "1", "--warmup", "0.5", "--new", "4", "--prompt-words", "4,8",
               "--systems", "devmap,devmap+tp", "--gpus", "2", "--restart", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "SERVE_BENCH_LOGS": str(tmp_path),
                                 "DEVMAP_BENCH_TMP": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "serve_llama-tiny.json").read_text())
    assert set(rows) == {"devmap/2gpu", "devmap+tp/2gpu"}
    assert all(row["requests"] > 0 and row["tokens_per_s"] > 0 for results in rows.values() for row in results)
    assert "| devmap+tp/2gpu | 2 |" in result.stdout
    start = rows["devmap/2gpu"][0]["start"]  # where each server's start went, as it said
    assert start["startup_s"]["core_process"] > 0 and "command_line_loads" in start["startup_s"]
    assert all({"plan", "weights"} <= set(load["load_seconds"]) for load in start["loads"].values())
    assert "devmap/2gpu start: core_process" in result.stdout
    again = rows["devmap/2gpu"][0]
    assert again["restart_s"] > 0 and again["restart_first_window"]["requests"] > 0  # --restart: its first window
    assert "devmap/2gpu restart: the first window of 2 clients on compiled steps" in result.stdout


def test_the_benchmark_of_a_load_beside_serving_runs_on_the_cpu(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", "llama-tiny", "--cpu-check",
               "--clients", "2", "--seconds", "1", "--warmup", "0.5", "--pause", "0.3", "--new", "4", "--rounds", "2",
               "--max-batch", "4", "--max-prompt-tokens", "128", "--prompt-words", "4,8", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "SERVE_BENCH_LOGS": str(tmp_path), "DEVMAP_BENCH_TMP": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    row = json.loads((tmp_path / "serve_load_llama-tiny.json").read_text())
    assert row["steady"]["requests"] > 0 and len(row["loads"]) == 2
    assert all(load["loaded_s"] > 0 and {"plan", "weights"} <= set(load["load_seconds"]) for load in row["loads"])
    assert "| during load 2 |" in result.stdout and "load 2: answered" in result.stdout


def test_the_serving_benchmark_profiles_the_first_window_after_a_restart(tmp_path):
    """`--profile-seconds` records the engine core at each timed window's start and at the first window after a
    restart (the one that meets a new batch shape: where a restart's first tokens go)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model", "llama-tiny", "--cpu-check",
               "--clients", "2", "--seconds", "1", "--warmup", "0.5", "--new", "4", "--prompt-words", "4,8",
               "--systems", "devmap", "--gpus", "1", "--restart", "--profile-seconds", "0.3", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "SERVE_BENCH_LOGS": str(tmp_path), "DEVMAP_BENCH_TMP": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    traces = sorted((tmp_path / "profiles").glob("*.trace.json"))
    assert len(traces) == 2 and len(list((tmp_path / "profiles").glob("*.ops.txt"))) == 2, traces
    restart = result.stdout.index("devmap/1gpu-restart answers")
    assert "profile " in result.stdout[restart:result.stdout.index("the first window of 2 clients on compiled")]
