"""torch.compile for stage steps, region by region: a decoder layer (every layer of a model runs the same compiled
code, traced once), a decode step's context (mask, positions, rotary cos/sin) and its head. The glue between them (the
embedding, the loop over the layers) runs eager; devmap captures whole steps as CUDA graphs, so a replay pays no
Python for it.

Compiling a stage's step whole traces each of its layers again, so compiling grows with the depth, inductor's
on-disk cache filled or not. A layer compiled on its own is traced once whatever the depth, and its compiled code is
found in torch's on-disk caches at a restart. The price is a guard check per region on every call, which a captured
step does not pay and an uncaptured one does (a CPU step, or the last stage's when the head lives on another device).
docs/generation.md has the measurements (`benchmarks/probes/compile_regions.py`).

Regions are compiled without inductor's CUDA graphs (`mode=None`): devmap captures the steps itself, with their lanes'
static KV caches, per-stage graph pools and event ordering. The first call of a step compiles its regions (eager run),
the second captures it; a capture never compiles (a guard that fails there raises, and the step stays uncaptured).
torch keys compiled code by the function and its guards, so every step, lane and stage of the same kind shares it, and
its on-disk caches (inductor's FX graph and autotuning caches, on by default) make a fresh process compile faster.

A compile may run beside a serving thread's captures (`devmap serve --compile-beside`): its region calls lift that
thread's pause of the captures (`graphed_step.tracing_lifted`: guards and dynamo's tracing are host work), and the
backend's compile and every run of what it compiled pause them again (`graphed_step.device_work_paused`), so the
serving thread captures while dynamo traces, most of a restart's compile.

Where a store is set (`region_store.keep_regions_in`: `devmap serve` sets one in its compile cache), a dynamic region's
entries are compiled ahead of time and kept there, and a later process loads them without tracing.

`dynamic=True` compiles one region for every batch size and cache length: the sizes each region's caller names (rows,
tokens, cache columns) are symbolic, every other one fixed. A continuous batch meets a new shape whenever a service's
traffic grows, and a dynamic step meets it with a new capture where a fixed-shape one would compile again, at the
same time per step once warm (docs/serving.md, `benchmarks/probes/compile_shapes.py`). Making every size symbolic
instead compiles for minutes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from torch import nn

from ..compat import (call_decoder_layer, compile_backend, distinct_sizes, dynamic_dims, own_forward,
                      raise_recompile_limit)
from .graphed_step import captures_paused, device_work_paused, tracing_lifted
from .joined_projections import JoinedLayer
from .region_store import store_folder, stored_call
from .rotary import Rotary

BACKEND = "inductor"  # tests on CPU swap in "aot_eager": the same tracing and guards, no C++ compiler needed
RECOMPILE_LIMIT = 64  # a region has an entry per kind of step (decode, prefill, attention implementation, fixed
# shapes of `generate`'s lanes); torch's default of 8 is too few

Sizes = Callable[..., Iterable[tuple[torch.Tensor, tuple[int, ...]]]]
"""Given a region's arguments: (tensor, dimensions) whose sizes vary between its calls."""


class CaptureSafeBackend:
    """A dynamo backend (`name`'s: inductor) that pauses CUDA-graph captures while it compiles a graph (kernel loads,
    autotuning: device work that fails while any stream captures) and while what it compiled runs in a thread that
    lifted its pause for tracing. One object per backend name, so that dynamo's compiled entries are shared by every
    `torch.compile` of a region, as they are for the backend's name."""

    def __init__(self, name: str) -> None:
        self.name = self.__name__ = name

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with captures_paused():
            compiled = compile_backend(self.name)(graph, example_inputs)

        def run(*args: Any) -> Any:
            with device_work_paused():
                return compiled(*args)

        return run


_BACKENDS: dict[str, CaptureSafeBackend] = {}


def backend() -> CaptureSafeBackend:
    """The capture-safe backend for `BACKEND` (read at each compile: tests swap it)."""
    return _BACKENDS.setdefault(BACKEND, CaptureSafeBackend(BACKEND))


def compile_region(function: Callable[..., Any], dynamic: bool = False,
                   sizes: Sizes | None = None) -> Callable[..., Any]:
    """`function` compiled for fixed shapes (every lane of a `generate` call keeps its shape for the whole call), or
    with `dynamic` sizes: those `sizes(*args)` names at each call (one compile for every shape a service's
    continuous batches take)."""
    raise_recompile_limit(RECOMPILE_LIMIT)
    compiled = torch.compile(function, backend=backend(), dynamic=None if dynamic else False, fullgraph=False)
    if not dynamic:
        return compiled

    def sized_apart(*args: Any) -> Any:  # only eager calls and captures come here, never replays
        for tensor, dims in sizes(*args) if sizes is not None else ():
            dynamic_dims(tensor, dims)
        with distinct_sizes(), tracing_lifted():
            if store_folder() is None:
                return compiled(*args)
            return stored_call(function, BACKEND, args, compiled)

    return sized_apart


def but_last(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`tensor` with every dimension but its last (rows, tokens; not the model's widths)."""
    return tensor, tuple(range(tensor.dim() - 1))


def every_dim(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return tensor, tuple(range(tensor.dim()))


def context_sizes(context: dict[str, Any]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The varying sizes of a step's context: its mask's and positions' every dimension, its rotary cos/sin's but the
    last."""
    sizes = [every_dim(context[name]) for name in ("attention_mask", "position_ids")
             if isinstance(context.get(name), torch.Tensor)]
    return sizes + [but_last(t) for t in context.get("position_embeddings", ())]


def _layer(layer: nn.Module, joined: JoinedLayer | None, hidden: torch.Tensor, cache: Any, context: dict[str, Any],
           keyword: str) -> torch.Tensor:
    """One decoder layer: devmap's forward over its joined projections, else transformers' own."""
    if joined is not None:
        return joined(hidden, cache, context)
    return call_decoder_layer(layer, hidden, cache, context, keyword)


def _mixed(joined: JoinedLayer, flat: torch.Tensor, caches: tuple[Any, Any],
           contexts: tuple[dict[str, Any], dict[str, Any]]) -> torch.Tensor:
    """One joined layer over a decode step's rows and a pack of prompts (`JoinedLayer.mixed`); the rows counted from
    the step's positions, a size, so that a dynamic compile serves every row count."""
    return joined.mixed(flat, contexts[0]["position_ids"].shape[0], caches, contexts)


def _context(rotary: Rotary, hidden: torch.Tensor, inputs: Any) -> dict[str, Any]:
    """A decode step's mask, position ids and rotary cos/sin for its rows (`hidden`: rows × 1 × hidden size), from the
    lane's `DecodeInputs` on this stage (the mask marks the column the step writes) and the rotary embedding on the
    stage's device. Regions take the modules and tensors they read, not the stages holding them: what a region
    takes is what its compiled code keeps of it (`region_store`)."""
    position_ids = inputs.position_ids()
    return {"attention_mask": inputs.mask(), "position_ids": position_ids,
            "position_embeddings": rotary(hidden, position_ids)}


def _logits(norm: nn.Module, head: nn.Module, hidden: torch.Tensor, norm_device: torch.device,
            head_device: torch.device) -> torch.Tensor:
    """The float logits of each row's last token: the final norm on its device, lm_head on its own."""
    normed = own_forward(norm)(hidden.to(norm_device)).to(head_device)
    return own_forward(head)(normed)[:, -1].float()


class Regions:
    """What a stage step repeats, eager or compiled (`devmap.generation.compiled`): a decoder layer, a pack-carrying
    layer, a decode step's context and its logits."""

    def __init__(self, dynamic: bool | None = None) -> None:
        """Eager with `dynamic` None, else compiled (for every size, or fixed ones)."""
        self.compiled, self.dynamic = dynamic is not None, bool(dynamic)
        self.layer, self.mixed, self.context, self.logits = _layer, _mixed, _context, _logits
        if dynamic is None:
            return
        self.layer = compile_region(_layer, self.dynamic, lambda layer, joined, hidden, cache, context, keyword: [
            but_last(hidden), *context_sizes(context)])
        self.mixed = compile_region(_mixed, self.dynamic, lambda joined, flat, caches, contexts: [
            but_last(flat), *context_sizes(contexts[0]), *context_sizes(contexts[1])])
        self.context = compile_region(_context, self.dynamic, lambda rotary, hidden, inputs: [but_last(hidden)])
        self.logits = compile_region(_logits, self.dynamic, lambda norm, head, hidden, *devices: [but_last(hidden)])
