"""Gradient sums shared by one pipeline stage's micro-batch graphs, handed to autograd once per backward pass.

Every micro-batch's backward graphs add their parameter gradients into the stage's sums inside the graph (no
per-micro-batch gradient copies launched from the host). The parameters reach autograd through one gate node
per stage and pass: each micro-batch's replay takes the gate's empty "phony" output as an input, so the
gate's backward runs once, after the input half of every micro-batch of the stage. It then runs the deferred
weight halves (devmap.pipelining.weight_grads) and returns the sums as the parameters' gradients. The input gradients
have left for the previous stage by then: the weight work fills the drain instead of delaying them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..compat import foreach_add_, foreach_copies, foreach_zero_
from ..errors import PipelineError


class GradSums:
    """One buffer per parameter, summed over a pass's micro-batches, and which pass is live."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.sums = [torch.zeros_like(p) for p in params]
        self.index = {id(p): i for i, p in enumerate(params)}
        self.generation = 0

    def add_into(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """sums[param] += grad for each pair (inside a captured graph: one fused launch per group)."""
        if pairs:
            foreach_add_([self.sums[self.index[id(p)]] for p, _ in pairs], [g for _, g in pairs])

    def check_live(self, generation: int) -> None:
        if generation != self.generation:
            raise PipelineError(
                "a newer forward of the same batch shape ran before this backward, and the CUDA graphs keep one set "
                "of activations per shape: call backward after each forward, or build the pipeline with graphs='off'")


def open_pass(sums: GradSums, graphs: Sequence[Any], device: torch.device) -> torch.Tensor:
    """Start a forward pass (on the current stream): zero the sums and return the phony tensor that each of
    `graphs` takes as an input; its backward runs their weight halves and hands the sums to autograd."""
    sums.generation += 1
    return _PassGate.apply(sums, list(graphs), sums.generation, device, *sums.params)


class _PassGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, sums: GradSums, graphs: list, generation: int, device: torch.device,
                *params: torch.Tensor) -> torch.Tensor:
        if sums.sums:
            foreach_zero_(sums.sums)
        ctx.sums, ctx.graphs, ctx.generation = sums, graphs, generation
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> Any:
        ctx.sums.check_live(ctx.generation)
        for graph in ctx.graphs:
            graph.run_weight_half()
        sums = ctx.sums.sums
        if not sums:
            return (None, None, None, None)
        # autograd gets its own copy, made in one fused launch (not one clone per parameter): .grad never aliases
        # the sums that the next pass zeroes
        return (None, None, None, None, *foreach_copies(sums))
