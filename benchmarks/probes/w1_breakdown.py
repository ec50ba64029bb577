"""Where the tutorial's train() spends its time, phase by phase on the host: Single GPU vs devmap's pipeline.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/w1_breakdown.py
Each phase is timed with perf_counter around the harness's own statements (3 batches x 10 calls);
a phase that blocks on the GPU (a pageable copy, a synchronize) shows the GPU work it waited for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from functools import partial

import torch

from devmap.comparison import tutorial_models as tm
from devmap.comparison.compare_systems import devmap_systems
from devmap.comparison.timing import HarnessConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import PHASES, phases

def main() -> None:
    cfg = HarnessConfig()
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    systems = {"Single GPU": lambda: tm.single_resnet50(devs[0])}
    systems |= {k: partial(b, devs, cfg) for k, b in devmap_systems(devs, cfg).items()}
    print(f"ms per batch (3 batches x 10 train() calls), torch {torch.__version__}")
    print(f"{'system':<38}" + "".join(f"{p:>10}" for p in PHASES) + f"{'total':>9}")
    for name, build in systems.items():
        row = phases(build(), devs, cfg, calls=10)
        print(f"{name:<38}" + "".join(f"{row[p]:>10.2f}" for p in PHASES) + f"{sum(row.values()):>9.2f}", flush=True)


if __name__ == "__main__":
    main()
