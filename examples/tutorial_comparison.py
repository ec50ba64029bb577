"""The PyTorch model-parallel tutorial's timing experiment (single device vs model parallel vs pipelined, the
split-size sweep), with devmap's pipeline beside it, written as results.json and the tutorial's plots.

Shows: devmap.comparison as a library (the same code as `devmap compare`).
Run: python examples/tutorial_comparison.py --out compare-out            (two GPUs: the tutorial's sizes)
     python examples/tutorial_comparison.py --out compare-out --small    (CPU: tiny images and batches)
"""

import argparse

import torch

from devmap.comparison.compare_systems import devmap_systems
from devmap.comparison.plots import save_results, write_plots
from devmap.comparison.timing import HarnessConfig, parse_devices, run_comparison

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="compare-out")
parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU")
args = parser.parse_args()

small = args.small or torch.cuda.device_count() < 2
devices = parse_devices(["cpu", "cpu"] if small else ["cuda:0", "cuda:1"])
config = (HarnessConfig(num_batches=1, batch_size=8, image_w=32, image_h=32, num_classes=10, repeat=1,
                        pipeline_split_size=4, split_sizes=(4, 8)) if small else HarnessConfig())
result = run_comparison(devices, config, extra_systems=devmap_systems(devices, config))
save_results(result, args.out)
for path in write_plots(result, args.out):
    print("wrote", path)
for name, timing in result.to_dict()["systems"].items():
    print(f"{name:<40} {timing['mean']:.3f} s per train()")
