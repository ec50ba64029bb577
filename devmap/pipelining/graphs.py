"""CUDA graphs for one pipeline stage and one micro-batch slot: forward, input half and weight half of backward.

At small micro-batches a GPU spends longer launching kernels than running them, and a replayed graph launches
them all at once (benchmarks/RESULTS.md, W1 and W2). Each (stage, slot) gets its own graphs and memory pool, so
the activations of every micro-batch in flight stay intact until its backward, in whatever order the
autograd engine runs the backwards. Backward is captured in two halves where the stage allows it
(devmap.pipelining.weight_grads): the input half (the gradient the previous stage waits for, plus the gradients of
parameters outside Linear/convolution layers) and the weight half, which the pipeline runs after the pass's
last input half so it fills the drain. Both halves add into the stage's shared gradient sums
(devmap.pipelining.grad_sums) inside the graph.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from ..compat import graph_pool
from ..errors import PipelineError
from .grad_sums import GradSums
from .weight_grads import CallRecorder, close, deferrable, deferred_parameters, input_half, split_grads, weight_grads


class StageGraph:
    """A stage's forward (and, when training, its backward in one or two halves) captured for one input shape."""

    def __init__(self, module: nn.Module, sample: torch.Tensor, backward: bool, warmup: int = 2,
                 sums: GradSums | None = None, split: bool = False) -> None:
        device = sample.device
        self.module = module
        self.backward = backward
        self.sums = sums if sums is not None else GradSums(
            [p for p in module.parameters() if p.requires_grad] if backward else [])
        self.params = self.sums.params  # the order in which backward returns the sums
        self.input_requires_grad = backward and sample.requires_grad
        self.static_in = sample.detach().clone().requires_grad_(self.input_requires_grad)
        self.wgt: torch.cuda.CUDAGraph | None = None
        saved = [b.detach().clone() for b in module.buffers()]  # warm-up and capture must not change BN stats
        pool = graph_pool()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        recorder = CallRecorder(module)
        self.split = backward and split
        with torch.cuda.device(device), torch.cuda.stream(side), torch.set_grad_enabled(backward):
            for step in range(warmup):
                with recorder:
                    out = module(self._input())
                if backward:
                    if step == warmup - 1 and self.split:
                        self.split = self._split_agrees(out, deferrable(module, recorder.calls))
                    else:
                        torch.autograd.grad(out, self._grad_inputs(self.params), torch.ones_like(out),
                                            allow_unused=True)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.fwd = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.set_grad_enabled(backward):
            # torch.cuda.graph's default capture stream lives on the first device it was used on: pass ours
            with torch.cuda.graph(self.fwd, pool=pool, stream=side), recorder:
                self.static_out = module(self._input())
            if backward:
                self._capture_backward(module, recorder, pool, side)
                self.static_out = self.static_out.detach()  # its autograd graph is spent: keep the buffer only
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)

    def _capture_backward(self, module: nn.Module, recorder: CallRecorder, pool: Any, side: torch.cuda.Stream) -> None:
        calls = deferrable(module, recorder.calls) if self.split else []
        deferred = deferred_parameters(calls)
        early = [p for p in self.params if id(p) not in deferred]
        self.static_grad_out = torch.zeros_like(self.static_out)
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd, pool=pool, stream=side), _quiet_if_empty():
            grads_in, early_grads, self.static_out_grads = input_half(
                self.static_out, self.static_grad_out, self._grad_inputs([]), early, calls)
            self.sums.add_into([(p, g) for p, g in zip(early, early_grads) if g is not None])
        self.static_grad_in = grads_in[0] if grads_in else None
        if calls:
            self.wgt = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.wgt, pool=pool, stream=side):
                self.sums.add_into(list(weight_grads(calls, self.static_out_grads)))

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

    def upload(self) -> None:
        """Replay every graph once and wait: a graph's first launch uploads it to the GPU (milliseconds for a
        stage of hundreds of kernels), which would otherwise land in the first training step. The caller restores
        BatchNorm statistics afterwards; the gradient sums are zeroed when the next pass opens."""
        with torch.cuda.device(self.static_in.device):
            self.replay_step()
            torch.cuda.current_stream().synchronize()

    def replay_step(self) -> None:
        """Forward and (when captured) whole backward once, gradients into this graph's sums (for timing a stage)."""
        self.fwd.replay()
        if self.backward:
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
        ctx.done = True
        graph.static_grad_out.copy_(grad_out)
        graph.run_input_half()  # the parameters' gradients stay in the sums until the pass gate hands them over
        return None, None, torch.zeros(ctx.phony_shape, device=grad_out.device), graph.static_grad_in
