"""W2 ablation (ResNet50 224x224 training on 2 GPUs): which part of devmap's pipeline buys what.

Layouts: `two` (stage 0 ends with layer2.0's head), `twob` (stage 0 ends after layer2.0), `four` (4 stages
interleaved over the GPUs as [0, 1, 0, 1], partitioned by profiled unit times). Backward: `whole` (one graph
per micro-batch) or `split` (input and weight halves; `-kN` defers the weight half of N micro-batches per stage,
`-kall` of all). `-prio` gives later stages higher CUDA stream priority.

Run on nvidia-h200-x2:
  PYTHONPATH=. python3 benchmarks/probes/w2_ablation.py 1024 16 two-whole,two-split-k1,two-split-k4,two-split-kall
  PYTHONPATH=. python3 benchmarks/probes/w2_ablation.py 1024 16 \
      four-whole,four-split-kall,four-split-kall-prio --profile
"""
from pathlib import Path
import sys

import torch
import torchvision

import devmap.pipelining.graphs as G
import devmap.pipelining.pipe as P
from devmap.pipelining import pipeline
import devmap.pipelining.streams as S
from devmap.pipelining.balance import partition, profile_blocks
from devmap.comparison.compare_systems import stages_from_names
from devmap.pipelining.stages import blocks_of, group_stages, merge_units, split_units
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import time_steps, training_step  # the W2 step, as the benchmark times it

NAMES = [n for n, _ in blocks_of(torchvision.models.resnet50())]
D0, D1 = torch.device("cuda:0"), torch.device("cuda:1")
PRIO = {"on": False}


class WholeGraph(G.StageGraph):
    def __init__(self, *a, **k):
        k["split"] = False
        super().__init__(*a, **k)


_orig_get = S.StreamSet.get


def prio_get(self, kind, stage, device):
    key = (kind, stage, device)
    if key not in self._streams:
        prio = -stage if (PRIO["on"] and kind == "compute") else 0
        self._streams[key] = torch.cuda.Stream(device, priority=prio)
    return self._streams[key]


S.StreamSet.get = prio_get


def two_names(whole=False):
    i = NAMES.index("layer2.0")
    if whole:
        return [NAMES[:i + 1], NAMES[i + 1:]], [D0, D1]
    return [NAMES[:i] + ["layer2.0[head]"], ["layer2.0[tail]"] + NAMES[i + 1:]], [D0, D1]


def four_names(micro):
    model = torchvision.models.resnet50().to(D0)
    blocks = blocks_of(model)
    units = split_units(blocks)
    times = profile_blocks(units, [D0] * len(units), micro.to(D0))
    owner = partition(times, 4)
    stage_t = [sum(t for t, o in zip(times, owner) if o == s) * 1000 for s in range(4)]
    devs = [D0, D1, D0, D1]
    out_units, out_devs = merge_units(units, [devs[o] for o in owner], blocks)
    names = [[n for n, _ in group] for group, _ in group_stages(out_units, out_devs)]
    print(f"  four-stage partition at micro-batch {micro.shape[0]}: stage ms {[round(t, 2) for t in stage_t]}; "
          f"ends {[g[-1] for g in names[:-1]]}", flush=True)
    del model
    torch.cuda.empty_cache()
    return names, devs


def profile(step):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        step()
        for d in (0, 1):
            torch.cuda.synchronize(d)
    busy, spans = {}, {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy.setdefault(e.device_index, []).append((e.time_range.start, e.time_range.end))
    for d, iv in sorted(busy.items()):
        iv.sort()
        total, cur_s, cur_e = 0, None, None
        for s, e in iv:  # union of intervals (two streams may overlap)
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += cur_e - cur_s
        spans[d] = (iv[0][0], max(e for _, e in iv))
        print(f"    gpu {d}: busy {total / 1000:.1f} ms of span {(spans[d][1] - spans[d][0]) / 1000:.1f} ms",
              flush=True)


def main():
    batch, chunks = int(sys.argv[1]), int(sys.argv[2])
    configs = sys.argv[3].split(",")
    do_profile = "--profile" in sys.argv
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device=D0)
    labels = torch.zeros(batch, 1000, device=D0).scatter_(1, torch.randint(0, 1000, (batch, 1), device=D0), 1)
    m = torchvision.models.resnet50().to(D0)
    base = time_steps(m, x, labels, 5)
    print(f"batch {batch} chunks {chunks}: one GPU {base:.1f} ms", flush=True)
    del m
    torch.cuda.empty_cache()
    four = None
    rows = []
    for config in configs:
        layout, mode, *rest = config.split("-")
        PRIO["on"] = "prio" in rest
        P.StageGraph = G.StageGraph if mode == "split" else WholeGraph
        if layout.startswith("two"):
            names, devs = two_names(whole=layout == "twob")
        else:
            if four is None:
                four = four_names(x[: -(-batch // chunks)])
            names, devs = four
        for d in (0, 1):
            torch.cuda.reset_peak_memory_stats(d)
        try:
            ks = [r[1:] for r in rest if r.startswith("k")] or ["all"]
            pipe = pipeline(stages_from_names(torchvision.models.resnet50(), names, devs), chunks=chunks,
                              deferred_weights=None if ks[0] == "all" else int(ks[0]))
            ms = time_steps(pipe, x, labels, 5)
        except torch.OutOfMemoryError as exc:
            print(f"  {config:<18} OOM {str(exc).splitlines()[0][:100]}", flush=True)
            torch.cuda.empty_cache()
            continue
        splits = sum(g is not None and g.wgt is not None for row in next(iter(pipe._graphs.values())) for g in row)
        mem = [torch.cuda.max_memory_reserved(d) / 2**30 for d in (0, 1)]
        print(f"  {config:<18} {ms:7.1f} ms  {base / ms:.3f}x  split graphs {splits}  "
              f"failures {len(pipe.graph_failures)}  peak reserved {mem[0]:.1f}/{mem[1]:.1f} GiB", flush=True)
        rows.append((config, ms))
        if do_profile:
            profile(training_step(pipe, x, labels))
        del pipe
        torch.cuda.empty_cache()
    print(f"\nsummary batch {batch} chunks {chunks}, one GPU {base:.1f} ms")
    for config, ms in rows:
        print(f"  {config:<18} {ms:7.1f} ms  {base / ms:.3f}x")


main()
