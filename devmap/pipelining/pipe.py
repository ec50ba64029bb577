"""A micro-batch pipeline whose stages run at the same time on their devices, for inference and training.

Schedule: fill-drain (GPipe). At clock k, stage j runs micro-batch k - j; one worker thread per stage
launches its work, so no stage waits for another stage's kernel launches. On CUDA each stage has a
compute stream, and hand-offs go through devmap.pipelining.streams (ordered by events; a copy never waits for,
or holds up, either stage's compute). Backward
is run by PyTorch's autograd engine, which keeps one thread per device and each backward op on its
forward op's stream, so the stages' backwards also overlap. Each (stage, micro-batch) is replayed as a
CUDA graph where its stage can be captured (see devmap.pipelining.graphs: one memory pool per stage, shared by
its micro-batches as eager memory would be); otherwise the stage runs eagerly. With graphs, each
stage runs the input half of every micro-batch's backward first and the weight half after the pass's
last one (devmap.pipelining.weight_grads), so the previous stage gets its gradients sooner and the weight work fills
the drain; gradients are summed inside the graphs and reach `.grad` once per backward pass.

BatchNorm normalizes each micro-batch on its own (as in the PyTorch tutorial's pipeline), so training
outputs differ from the unsplit model's unless there is one micro-batch; in eval mode they are equal.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import PipelineError
from ..planning.devices import offloaded, parse_device_key
from .grad_sums import GradSums, open_pass
from .graphs import StageGraph, capture_stage
from .stages import block_devices, group_stages, placed_units, stage_module
from .streams import StreamSet, hand_off
from .workers import StageWorkers

GRAPH_MODES = ("auto", "on", "off")


class Pipeline(nn.Module):
    """Stages (nn.Modules on devices) run as a micro-batch pipeline; an nn.Module like any other."""

    def __init__(self, stages: Sequence[tuple[nn.Module, torch.device]], chunks: int | None = None,
                 split_size: int | None = None, graphs: str = "auto", deferred_weights: int | None = 1) -> None:
        super().__init__()
        if chunks is not None and split_size is not None:
            raise PipelineError("give chunks (number of micro-batches) or split_size (rows per micro-batch), not both")
        for name, value in (("chunks", chunks), ("split_size", split_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PipelineError(f"invalid {name}={value!r}: it must be a positive integer")
        if deferred_weights is not None and (isinstance(deferred_weights, bool) or not isinstance(deferred_weights, int)
                                             or deferred_weights < 0):
            raise PipelineError(f"invalid deferred_weights={deferred_weights!r}: give a count of micro-batches (0 "
                                "turns deferral off) or None for all of them")
        if graphs not in GRAPH_MODES:
            raise PipelineError(f"invalid graphs={graphs!r}: use one of {', '.join(GRAPH_MODES)}")
        self.partitions = nn.ModuleList([module for module, _ in stages])
        self.devices = [device for _, device in stages]
        self.chunks = chunks if chunks is not None or split_size is not None else 1
        self.split_size = split_size
        self.graphs = graphs
        self.graph_failures: list[str] = []
        self._graphs: dict[tuple, list[list[StageGraph | None]]] = {}
        self._sums: dict[tuple, list[GradSums]] = {}  # per graph set: each stage's gradient sums
        # micro-batches per stage whose backward's weight half waits for the end of the pass (None: all): one
        # fills the drain as well as all of them do, for a fraction of the memory (benchmarks/RESULTS.md, W2)
        self.deferred_weights = deferred_weights
        self._streams = StreamSet()
        self.trace: list[tuple[int, int, Any, Any]] | None = None  # (stage, micro-batch, start, end) events

    def timeline(self, origins: dict[torch.device, Any] | None = None) -> list[tuple[int, int, float, float]]:
        """With `trace = []` set before a forward: (stage, micro-batch, start ms, end ms) of each CUDA task,
        from `origins` (an event per device, recorded while the devices were idle, so that they mark one
        instant) or else from the first traced event on each device."""
        if not self.trace:
            return []
        origins = dict(origins or {})
        rows = []
        for stage, micro, start, end in self.trace:
            end.synchronize()
            origin = origins.setdefault(self.devices[stage], start)
            rows.append((stage, micro, origin.elapsed_time(start), origin.elapsed_time(end)))
        return rows

    def extra_repr(self) -> str:
        size = f"split_size={self.split_size}" if self.split_size else f"chunks={self.chunks}"
        return f"devices={[str(d) for d in self.devices]}, {size}, graphs={self.graphs}"

    def micro_batches(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split along the batch dimension: `split_size` rows each, or `chunks` near-equal parts."""
        rows = self.split_size or math.ceil(x.shape[0] / self.chunks)
        return list(x.split(max(1, rows)))

    def prepare(self, sample: torch.Tensor) -> "Pipeline":
        """Capture the CUDA graphs for batches shaped like `sample` now (in the current train/eval and grad
        mode) instead of at the first forward; touches no gradient and no BatchNorm statistic."""
        self._runners(self.micro_batches(sample))
        return self

    def reset_graphs(self) -> None:
        """Forget captured graphs (needed after parameters are replaced rather than updated in place)."""
        self._graphs.clear()
        self._sums.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise PipelineError(f"a pipeline takes one tensor batch, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] == 0:
            raise PipelineError("a pipeline needs a non-empty batch dimension")
        micro = self.micro_batches(x)
        runners = self._open_pass(self._runners(micro))
        grad = torch.is_grad_enabled()
        start = None
        if x.is_cuda:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(x.device))
        carry: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [(mb, start) for mb in micro]
        m, n = len(micro), len(self.partitions)
        with StageWorkers(n) as workers:
            for clock in range(m + n - 1):
                tasks = [(j, self._task(clock - j, j, carry, runners, grad))
                         for j in range(n) if 0 <= clock - j < m]
                workers.run(tasks)
        return self._gather(carry)

    def _open_pass(self, rows: list[list[Any]]) -> list[list[Callable]]:
        """Each stage's compute stream waits for the caller's work on its device (an optimizer step, the last
        pass's gradients being read); training graphs get their stage's pass gate (devmap.pipelining.grad_sums)."""
        runners = []
        for j, (row, device) in enumerate(zip(rows, self.devices)):
            if device.type != "cuda":
                runners.append(row)
                continue
            compute = self._streams.get("compute", j, device)
            compute.wait_stream(torch.cuda.current_stream(device))
            graphs = [g for g in row if isinstance(g, StageGraph) and g.backward]
            if not graphs or not torch.is_grad_enabled():
                runners.append(row)
                continue
            with torch.cuda.device(device), torch.cuda.stream(compute):
                phony = open_pass(graphs[0].sums, graphs, device)
            runners.append([functools.partial(g, phony=phony) if isinstance(g, StageGraph) else g for g in row])
        return runners

    def _task(self, i: int, j: int, carry: list, runners: list[list[Callable]], grad: bool) -> Callable[[], None]:
        def task() -> None:
            torch.set_grad_enabled(grad)  # grad mode is thread-local
            x, event = carry[i]
            device = self.devices[j]
            if device.type != "cuda":
                carry[i] = (runners[j][i](x.to(device)), None)
                return
            compute = self._streams.get("compute", j, device)
            with torch.cuda.device(device):
                x = hand_off(x, event, device, j, self._streams, compute)
                if self.trace is not None:
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(compute)
                with torch.cuda.stream(compute):
                    out = runners[j][i](x)
                done = torch.cuda.Event(enable_timing=self.trace is not None)
                done.record(compute)
                if self.trace is not None:
                    self.trace.append((j, i, begin, done))
            carry[i] = (out, done)

        return task

    def _gather(self, carry: list) -> torch.Tensor:
        outputs = [out for out, _ in carry]
        last = self.devices[-1]
        if last.type == "cuda":
            stream = torch.cuda.current_stream(last)
            for out, event in carry:
                if event is not None:
                    stream.wait_event(event)
                out.record_stream(stream)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0].clone()

    def _runners(self, micro: list[torch.Tensor]) -> list[list[Callable]]:
        """For each stage and micro-batch: its CUDA graph, or the stage module itself."""
        eager = [[stage] * len(micro) for stage in self.partitions]
        if self.graphs == "off" or not any(d.type == "cuda" for d in self.devices):
            return eager
        backward = torch.is_grad_enabled()
        key = (tuple(tuple(mb.shape) for mb in micro), micro[0].dtype, backward, self.training)
        if key not in self._graphs:
            self._graphs[key] = self._capture(micro, backward, key)
        return [[g if g is not None else stage for g in row] for row, stage in zip(self._graphs[key], self.partitions)]

    def _capture(self, micro: list[torch.Tensor], backward: bool, key: tuple) -> list[list[StageGraph | None]]:
        """Capture each stage's micro-batch slots once, sequentially, before any concurrent work. Each micro-batch
        gets its own graphs (its own activations) in its stage's one memory pool; the shapes only choose samples."""
        saved = [b.detach().clone() for b in self.buffers()]  # sample passes must not move BN statistics
        inputs = {tuple(mb.shape): mb.detach() for mb in micro}
        rows: list[list[StageGraph | None]] = []
        self._sums[key] = []
        for j, (stage, device) in enumerate(zip(self.partitions, self.devices)):
            sums = GradSums([p for p in stage.parameters() if p.requires_grad] if backward else [])
            self._sums[key].append(sums)
            samples = {}
            for shape, x in inputs.items():
                samples[shape] = x.to(device)
                with torch.no_grad():
                    inputs[shape] = stage(samples[shape]).detach()
            slots = []
            for mb in micro:
                x = samples[tuple(mb.shape)].clone()
                slots.append(x.requires_grad_(backward and j > 0 and x.is_floating_point()))
            splits = [self._defers_weights(j, i, len(micro)) for i in range(len(micro))]
            rows.append(self._capture_stage(stage, slots, backward, j, sums, splits) if device.type == "cuda"
                        else [None] * len(micro))
        with torch.no_grad():
            for buffer, value in zip(self.buffers(), saved):
                buffer.copy_(value)
        return rows

    def _defers_weights(self, j: int, i: int, m: int) -> bool:
        """Whether stage j splits micro-batch i's backward and leaves its weight half for the end of the pass.

        Only a stage that hands a gradient back (j > 0) gains, and only for the micro-batches whose input
        gradients the earlier stage waits for first (the last ones forward, the first ones backward): their
        weight work moves into the drain. Each deferred micro-batch keeps the gradients at its layers' outputs
        until then, so `deferred_weights` (None: all) bounds the memory this costs."""
        count = m if self.deferred_weights is None else self.deferred_weights
        return j > 0 and i >= m - count

    def _capture_stage(self, stage: nn.Module, slots: list[torch.Tensor], backward: bool, j: int,
                       sums: GradSums, splits: list[bool]) -> list[StageGraph | None]:
        try:
            return capture_stage(stage, slots, backward, sums, splits)
        except Exception as exc:  # capture unsupported by this stage: the whole stage runs eagerly
            reason = str(exc).splitlines()[0]
            if self.graphs == "on":
                raise PipelineError(f"stage {j} cannot be captured as a CUDA graph: {reason}") from None
            self.graph_failures.append(f"stage {j}: {reason}")
            torch.cuda.synchronize(slots[0].device)
            return [None] * len(slots)


def check_placed(model: nn.Module) -> None:
    """A model the pipeline can take: placed (hf_device_map) with no block offloaded beside GPUs."""
    if not isinstance(model, nn.Module):
        raise PipelineError("pipeline() takes an nn.Module or a list of (module, device) stages, "
                            f"got {type(model).__name__}")
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        raise PipelineError(
            "the model has no placement: place it with devmap.load(...) or devmap.dispatch(model, device_map=...), "
            "or pass explicit stages [(module, device), ...]"
        )
    if offloaded(parse_device_key(d) for d in device_map.values()):
        raise PipelineError("the model has offloaded blocks (cpu or disk beside GPUs): give it enough GPU memory "
                            "to hold every block before pipelining it")
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)  # the pipeline moves activations itself


def from_placement(model: nn.Module, chunks: int | None = None, split_size: int | None = None, graphs: str = "auto",
                   deferred_weights: int | None = 1) -> Pipeline:
    """The Pipeline of a placed model as its device map says: consecutive units on one device form a stage."""
    check_placed(model)
    units = placed_units(model)
    devices = block_devices(model, units)
    stages = []
    for stage_blocks, device in group_stages(units, devices):
        stages.append((stage_module(stage_blocks).to(device), device))
    pipe = Pipeline(stages, chunks, split_size, graphs, deferred_weights)
    pipe.block_names = [[name for name, _ in s] for s, _ in group_stages(units, devices)]
    return pipe

