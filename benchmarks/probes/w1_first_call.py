"""W1's timed runs each build and prepare a fresh model: is its first train() call slower than the next?

Per-step milliseconds (3 steps, then the final synchronize) of the first and second call, for one GPU and for
devmap's pipeline with and without one more replay of every captured graph after prepare (a graph's first
launch uploads it; `Pipeline.prepare` now does that replay itself, so both devmap rows should match).
Run on nvidia-h200-x2:  PYTHONPATH=. python3 benchmarks/probes/w1_first_call.py
"""
import time
import warnings

import torch
import torchvision

import devmap.pipelining as P
from devmap.comparison.compare_systems import stages_from_names
from devmap.pipelining.stages import blocks_of
from devmap.comparison.timing import HarnessConfig
from devmap.comparison import tutorial_models as tm

warnings.filterwarnings("ignore")
D0, D1 = torch.device("cuda:0"), torch.device("cuda:1")
NAMES = [n for n, _ in blocks_of(torchvision.models.resnet50())]
i = NAMES.index("layer2.1")
names = [NAMES[:i + 1], NAMES[i + 1:]]
cfg = HarnessConfig()


def build(warm):
    pipe = P.pipeline(stages_from_names(torchvision.models.resnet50(), names, [D0, D1]), chunks=2)
    pipe.train().prepare(torch.randn(120, 3, 128, 128, device=D0))
    if warm:
        saved = [b.detach().clone() for b in pipe.buffers()]
        for row in next(iter(pipe._graphs.values())):
            for g in row:
                with torch.cuda.device(g.static_in.device):
                    g.fwd.replay()
                    g.bwd.replay()
                    g.run_weight_half()
        with torch.no_grad():
            for b, v in zip(pipe.buffers(), saved):
                b.copy_(v)
        for d in (0, 1):
            torch.cuda.synchronize(d)
    return pipe


def train_steps(model):
    from torch import nn, optim
    model.train(True)
    loss_fn, opt = nn.MSELoss(), optim.SGD(model.parameters(), lr=0.001)
    idx = torch.LongTensor(120).random_(0, 1000).view(120, 1)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        inputs = torch.randn(120, 3, 128, 128)
        labels = torch.zeros(120, 1000).scatter_(1, idx, 1)
        opt.zero_grad()
        out = model(inputs.to(D0))
        labels = labels.to(out.device)
        loss_fn(out, labels).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for d in (0, 1):
        torch.cuda.synchronize(d)
    times.append(time.perf_counter() - t)
    return times


def show(name, times):
    print(f"  {name:<34} " + " ".join(f"{1000 * t:6.1f}" for t in times) + f"  total {1000 * sum(times):6.1f} ms",
          flush=True)


for rep in range(3):
    m = tm.single_resnet50(D0)
    show("single, first call", train_steps(m))
    show("single, second call", train_steps(m))
    del m
    for warm in (False, True):
        pipe = build(warm)
        show(f"devmap warm={warm}, first call", train_steps(pipe))
        show(f"devmap warm={warm}, second call", train_steps(pipe))
        del pipe
    torch.cuda.empty_cache()
