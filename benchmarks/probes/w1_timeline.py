"""W1 up close: devmap's pipeline in the tutorial's step (batch 120 at 128x128, 2 GPUs): host milliseconds per
statement, the GPU timeline of one forward (when each stage works on each micro-batch), a CPU profile.

Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/w1_timeline.py CHUNKS [LAST_BLOCK_OF_STAGE_0]
"""
from pathlib import Path
import cProfile
import io
import pstats
import sys
import time
import warnings

import torch
import torchvision
from torch import nn, optim

import devmap.pipelining as P
from devmap.comparison.compare_systems import stages_from_names
from devmap.pipelining.stages import blocks_of
from devmap.comparison.timing import HarnessConfig
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import phases  # host time per statement of the tutorial's train()

D0, D1 = torch.device("cuda:0"), torch.device("cuda:1")
NAMES = [n for n, _ in blocks_of(torchvision.models.resnet50())]
chunks = int(sys.argv[1])
cut = sys.argv[2] if len(sys.argv) > 2 else "layer2.1"
i = NAMES.index(cut)
names = [NAMES[:i + 1], NAMES[i + 1:]]
pipe = P.pipeline(stages_from_names(torchvision.models.resnet50(), names, [D0, D1]), chunks=chunks)
pipe.train().prepare(torch.randn(120, 3, 128, 128, device=D0))
loss_fn = nn.MSELoss()
opt = optim.SGD(pipe.parameters(), lr=0.001)
idx = torch.LongTensor(120).random_(0, 1000).view(120, 1)
inputs = torch.randn(120, 3, 128, 128)
labels_cpu = torch.zeros(120, 1000).scatter_(1, idx, 1)


def step():
    """One step of the tutorial's train(), on inputs made once (the per-statement table is w1_breakdown's)."""
    opt.zero_grad()
    out = pipe(inputs.to(D0))
    loss_fn(out, labels_cpu.to(out.device)).backward()
    opt.step()
    torch.cuda.synchronize(D0)
    torch.cuda.synchronize(D1)


warnings.filterwarnings("error", message="The AccumulateGrad")
for k in range(4):
    try:
        step()
        print(f"step {k}: no AccumulateGrad stream warning")
    except UserWarning as exc:
        print(f"step {k}: warning raised: {str(exc)[:80]}")
warnings.resetwarnings()
warnings.filterwarnings("ignore")
row = phases(pipe, [D0, D1], HarnessConfig(), calls=10)
print("host ms per batch in train(): " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))

# GPU timeline of one forward
for d in (0, 1):
    torch.cuda.synchronize(d)
origins = {}
for d in (D0, D1):
    origins[d] = torch.cuda.Event(enable_timing=True)
    origins[d].record(torch.cuda.current_stream(d))
pipe.trace = []
x = inputs.to(D0)
t0 = time.perf_counter()
out = pipe(x)
t1 = time.perf_counter()
done = torch.cuda.Event(enable_timing=True)
done.record(torch.cuda.current_stream(D1))
done.synchronize()
t2 = time.perf_counter()
print(f"forward host {1000 * (t1 - t0):.2f} ms, until output ready {1000 * (t2 - t0):.2f} ms")
for row in pipe.timeline(origins):
    print("  stage %d mb %d: %.2f .. %.2f ms" % row)
pipe.trace = None
out = None

# CPU profile of the main thread
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    step()
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
print(s.getvalue()[:9000])
