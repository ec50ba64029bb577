"""CUDA graphs for one pipeline stage: per micro-batch slot a forward, and an input half and a weight half of backward.

At small micro-batches a GPU spends longer launching kernels than running them, and a replayed graph launches
them all at once (benchmarks/RESULTS.md, W1 and W2). Each micro-batch slot gets its own graphs, so the activations
of every micro-batch in flight stay intact until its backward. All the slots of a stage share one memory pool,
captured in the order the pipeline replays them (`capture_stage`): every forward in micro-batch order, then the
input halves of backward from the last micro-batch to the first (the order PyTorch's autograd engine runs them
in), then the deferred weight halves. Memory a slot is done with (its backward's scratch, its activations once its
backward ran) is then reused by the next slot, as in eager PyTorch, instead of each slot keeping a pool of its
own; a backward that arrives in any other order is refused (`BackwardOrder`), never replayed over live memory.
Backward is captured in two halves where the stage allows it (devmap.pipelining.weight_grads): the input half (the
gradient the previous stage waits for, plus the gradients of parameters outside Linear/convolution layers) and the
weight half, which the pipeline runs after the pass's last input half so it fills the drain. Both halves add into
the stage's shared gradient sums (devmap.pipelining.grad_sums) inside the graph.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from ..compat import graph_pool, own_blas_workspace
from ..errors import PipelineError
from .grad_sums import GradSums
from .streams import new_stream
from .weight_grads import CallRecorder, close, deferrable, deferred_parameters, input_half, split_grads, weight_grads


class BackwardOrder:
    """The order in which a stage's slots were captured to run their input halves of backward, and where a pass is
    in it. Slots share one pool, so replaying a backward out of this order would overwrite a slot's live memory."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = slots
        self.generation = -1
        self.position = 0

    def check(self, slot: int, generation: int) -> None:
        if generation != self.generation:  # the first backward of a new pass
            self.generation, self.position = generation, 0
        expected = self.slots[self.position] if self.position < len(self.slots) else None
        if slot != expected:
            raise PipelineError(
                f"the backward of micro-batch {slot} ran before that of micro-batch {expected}, an order other than "
                "the one the pipeline's CUDA graphs were captured in (their micro-batches share memory): backward "
                "the pipeline's output as one tensor, or build the pipeline with graphs='off'")
        self.position += 1


class StageGraph:
    """A stage's graphs for one micro-batch slot and one input shape, in `pool`: made by `capture_stage`, which
    warms every slot up first, then captures the forwards, then (when training) the backwards."""

    def __init__(self, module: nn.Module, sample: torch.Tensor, backward: bool, pool: Any, side: torch.cuda.Stream,
                 sums: GradSums, split: bool = False, slot: int = 0) -> None:
        self.module = module
        self.backward = backward
        self.pool = pool
        self.side = side  # every capture into `pool` on one stream: the allocator reuses a block on its own stream only
        self.slot = slot
        self.order: BackwardOrder | None = None
        self.sums = sums  # the stage's, shared by its slots
        self.params = self.sums.params  # the order in which backward returns the sums
        self.input_requires_grad = backward and sample.requires_grad
        self.static_in = sample.detach().clone().requires_grad_(self.input_requires_grad)
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.wgt: torch.cuda.CUDAGraph | None = None
        self.recorder = CallRecorder(module)
        self.split = backward and split
        self.calls: list = []

    def warm_up(self, steps: int = 2) -> None:
        """Run eagerly on the capture stream (lazy initialization, cuDNN plans), and check the split once."""
        device = self.static_in.device
        self.side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(self.side), torch.set_grad_enabled(self.backward):
            for step in range(steps):
                with self.recorder:
                    out = self.module(self._input())
                if not self.backward:
                    continue
                if step == steps - 1 and self.split:
                    self.split = self._split_agrees(out, deferrable(self.module, self.recorder.calls))
                else:
                    torch.autograd.grad(out, self._grad_inputs(self.params), torch.ones_like(out), allow_unused=True)
                del out
        self.recorder.calls = []
        torch.cuda.current_stream(device).wait_stream(self.side)
        torch.cuda.synchronize(device)

    def capture_forward(self) -> None:
        with torch.cuda.device(self.static_in.device), torch.set_grad_enabled(self.backward):
            # torch.cuda.graph's default capture stream lives on the first device it was used on: pass ours
            with own_blas_workspace(), torch.cuda.graph(self.fwd, pool=self.pool, stream=self.side), self.recorder:
                self.static_out = self.module(self._input())

    def capture_input_half(self) -> None:
        """Capture backward's input half (all of backward when not split); the forward's autograd graph is spent."""
        calls = deferrable(self.module, self.recorder.calls) if self.split else []
        deferred = deferred_parameters(calls)
        early = [p for p in self.params if id(p) not in deferred]
        self.static_grad_out = torch.zeros_like(self.static_out)
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.static_in.device), own_blas_workspace(), \
                torch.cuda.graph(self.bwd, pool=self.pool, stream=self.side), _quiet_if_empty():
            grads_in, early_grads, self.static_out_grads = input_half(
                self.static_out, self.static_grad_out, self._grad_inputs([]), early, calls)
            self.sums.add_into([(p, g) for p, g in zip(early, early_grads) if g is not None])
        self.static_grad_in = grads_in[0] if grads_in else None
        self.static_out = self.static_out.detach()  # keep the buffer only
        self.calls = calls
        self.recorder.calls = []  # what the weight half needs is in `calls`: the rest of the forward may be freed

    def capture_weight_half(self) -> None:
        """Capture the deferred weight half, if the input half left one."""
        if self.calls:
            self.wgt = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.static_in.device), own_blas_workspace(), \
                    torch.cuda.graph(self.wgt, pool=self.pool, stream=self.side):
                self.sums.add_into(list(weight_grads(self.calls, self.static_out_grads)))
        self.calls = []
        self.static_out_grads = []

    def _split_agrees(self, out: torch.Tensor, calls: list) -> bool:
        """Whether the two halves give the gradients of one whole backward for this stage (checked once, eagerly)."""
        if not calls:
            return False
        try:
            ones = torch.ones_like(out)
            inputs = self._grad_inputs([])
            whole = torch.autograd.grad(out, inputs + self.params, ones, allow_unused=True, retain_graph=True)
            split_in, split_params = split_grads(out, ones, inputs, self.params, calls)
            return all(close(w, g) for w, g in zip(whole, split_in + split_params))
        except Exception:  # not splittable after all (an unusual layer, autocast, ...): one whole backward
            return False

    def _input(self) -> torch.Tensor:
        # a leaf that requires grad cannot be modified in place (a stage may start with ReLU(inplace=True))
        return self.static_in.clone() if self.input_requires_grad else self.static_in

    def _grad_inputs(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return ([self.static_in] if self.input_requires_grad else []) + params

    def run_input_half(self) -> None:
        self.bwd.replay()

    def run_weight_half(self) -> None:
        if self.wgt is not None:
            self.wgt.replay()

    def replay_step(self) -> None:
        """Forward and (when captured) whole backward once, gradients into this graph's sums (for timing a stage
        of one slot)."""
        self.fwd.replay()
        if self.bwd is not None:
            self.bwd.replay()
            self.run_weight_half()

    def __call__(self, x: torch.Tensor, phony: torch.Tensor | None = None) -> torch.Tensor:
        """Replay on the current stream. When captured with backward it is differentiable: the input gradient comes
        from the replay's backward and the parameters' from the pass gate whose `phony` output it takes
        (devmap.pipelining.grad_sums.open_pass)."""
        if self.backward:
            if phony is None:
                if self.params:
                    raise ValueError("a training replay needs the phony tensor of its pass (grad_sums.open_pass)")
                phony = torch.empty(0, device=x.device)
            return _Replay.apply(self, self.sums.generation, phony, x)
        self.static_in.copy_(x)
        self.fwd.replay()
        return self.static_out.detach()


def capture_stage(module: nn.Module, samples: list[torch.Tensor], backward: bool, sums: GradSums | None = None,
                  splits: list[bool] | None = None) -> list[StageGraph]:
    """One stage's graphs for each micro-batch slot (`samples[i]` shapes slot i), captured into one shared pool in
    the order a pipeline pass replays them, then each replayed once in that order: a graph's first launch uploads it
    to the GPU (milliseconds for a stage of hundreds of kernels), which would otherwise land in the first training
    step. The caller restores BatchNorm statistics afterwards (not in between: a copy between a slot's forward and
    its backward would fail autograd's version check); the gradient sums are zeroed when a pass opens."""
    pool, side = graph_pool(), new_stream(samples[0].device, "capture")
    splits = splits or [False] * len(samples)
    if sums is None:
        sums = GradSums([p for p in module.parameters() if p.requires_grad] if backward else [])
    graphs = [StageGraph(module, x, backward, pool, side, sums, split=split, slot=i)
              for i, (x, split) in enumerate(zip(samples, splits))]
    for graph in graphs:  # all eager work before any capture: the pool never sits beside a warm-up's memory
        graph.warm_up()
    for graph in graphs:
        graph.capture_forward()
    if backward:
        order = BackwardOrder(list(range(len(graphs)))[::-1])  # the autograd engine runs the newest first
        for i in order.slots:
            graphs[i].capture_input_half()
        for graph in graphs:
            graph.capture_weight_half()
            graph.order = order
    with torch.cuda.device(samples[0].device):
        for graph in graphs:
            graph.fwd.replay()
        for graph in reversed(graphs) if backward else []:
            graph.run_input_half()
        for graph in graphs if backward else []:
            graph.run_weight_half()
        torch.cuda.current_stream().synchronize()
    return graphs


@contextlib.contextmanager
def _quiet_if_empty() -> Iterator[None]:
    """A stage whose backward launches nothing (a Flatten, a ReLU on an input that needs no gradient) captures an
    empty graph; replaying it is a no-op, so torch's warning about it is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        yield


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: StageGraph, generation: int, phony: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        graph.static_in.copy_(x)
        graph.fwd.replay()
        ctx.graph, ctx.generation, ctx.done = graph, generation, False
        ctx.phony_shape = phony.shape
        return graph.static_out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        graph: StageGraph = ctx.graph
        graph.sums.check_live(ctx.generation)
        if ctx.done:  # the first replay overwrote activations it had finished with (graph memory is reused)
            raise PipelineError(
                "backward ran twice through one pipeline pass (retain_graph=True), which its CUDA graphs cannot do: "
                "run the forward again before each backward, or build the pipeline with graphs='off'")
        graph.order.check(graph.slot, ctx.generation)  # set for every graph captured with backward
        ctx.done = True
        graph.static_grad_out.copy_(grad_out)
        graph.run_input_half()  # the parameters' gradients stay in the sums until the pass gate hands them over
        return None, None, torch.zeros(ctx.phony_shape, device=grad_out.device), graph.static_grad_in
