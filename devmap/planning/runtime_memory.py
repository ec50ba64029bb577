"""The memory a workload needs beside the weights, per placement unit (a decoder layer, a residual block, a leaf
module), measured on the meta device: no memory is allocated and no weights are read.

- KV cache (generate, serve): per decoder layer, 2 × kv_heads × head_dim × dtype bytes × batch × seq_len (serve:
  and the joining packs' scratch cache, prefill_rows × seq_len).
- Transient activations: what a unit's forward creates and frees, at its peak, for one micro-batch (or lane;
  generate and serve: also a decode step's attention over the whole cache, `decode_attention_bytes`):
  every tensor an operator returns is counted while it is alive (views are not), so Python's freeing of
  intermediates is followed as a GPU's caching allocator follows it.
- Saved activations (train): what autograd keeps for backward (weights excluded), for every micro-batch (a
  fill-drain pipeline holds them all until its backward).
- Other (train): gradients and optimizer state, in the parameters' dtype. (serve): the captured joining prefills'
  input and output hidden states, on the first decoder layer's device (each later stage keeps its own too).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from unittest import mock
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..compat import cache_keyword, call_decoder_layer
from .workload import OPTIMIZER_STATES, Workload


@dataclass
class UnitRuntime:
    """Bytes a unit needs at run time beside its weights."""

    kv_cache: int = 0
    transient: int = 0
    saved: int = 0
    other: int = 0

    @property
    def held(self) -> int:
        """What stays allocated for the whole run (the transient peak comes and goes)."""
        return self.kv_cache + self.saved + self.other


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors operators returned that are still alive, and the peak since `start()`."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def start(self) -> int:
        self.peak = self.live
        return self.live

    def _freed(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(ret.alias_info is not None for ret in func._schema.returns):
            return out  # a view or an in-place result: no new memory
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                size = tensor.numel() * tensor.element_size()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, size)
        return out


def placement_units(model: nn.Module, no_split: list[str]) -> list[str]:
    """The modules a plan may place whole: instances of the no-split classes, and leaf modules outside them."""
    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if type(module).__name__ in no_split or not children:
            units.append(prefix)
            return
        for name, child in children:
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return units


def runtime_by_unit(model: nn.Module, workload: Workload, dtype: torch.dtype, no_split: list[str],
                    causal_lm: bool) -> dict[str, UnitRuntime]:
    """Each placement unit's runtime bytes under `workload` (see the module docstring)."""
    units = placement_units(model, no_split)
    out = {unit: UnitRuntime() for unit in units}
    measure = _measure_causal if causal_lm else _measure_vision
    with _working_model(model, dtype, copy_it=workload.kind == "train") as work:  # the plan keeps its own model
        with torch.no_grad():
            measure(work, workload, out, saved=None)
        if workload.kind == "train":
            weights = {id(p) for p in work.parameters()}
            measure(work, workload, out, saved=weights)
            states = 1 + OPTIMIZER_STATES[workload.optimizer]  # the gradient, then the optimizer's tensors
            for unit in units:
                owned = work.get_submodule(unit).parameters() if unit else work.parameters()
                out[unit].other = states * sum(p.numel() * p.element_size() for p in owned)
    if workload.kind in ("generate", "serve"):
        per_layer = layer_kv_bytes(model.config, dtype, workload.batch + workload.prefill_rows, workload.seq_len)
        decode = decode_attention_bytes(model.config, dtype, workload.micro_batch, workload.seq_len)
        prefix = _layers_prefix(units)
        if workload.captured_tokens and f"{prefix}0" in out:
            out[f"{prefix}0"].other = 2 * workload.captured_tokens * model.config.hidden_size * dtype.itemsize
        for unit in units:
            if unit.startswith(prefix) and unit[len(prefix):].isdigit():
                out[unit].kv_cache = per_layer
                out[unit].transient = max(out[unit].transient, decode)
    return out


def layer_kv_bytes(config: Any, dtype: torch.dtype, rows: int, tokens: int) -> int:
    """One decoder layer's KV cache: keys and values of `tokens` tokens in each of `rows` rows."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize * rows * tokens


def decode_attention_bytes(config: Any, dtype: torch.dtype, rows: int, tokens: int) -> int:
    """A decode step's attention transient in one layer over a cache of `tokens`: with grouped KV heads and a mask,
    transformers' attention repeats the keys and values to every query head before the kernel (`repeat_kv`), so a
    decode step of many rows over a long cache briefly holds them all expanded (often more than a prefill of
    a few rows does)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads == heads:
        return 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * rows * heads * tokens * head_dim * dtype.itemsize


@contextlib.contextmanager
def _working_model(model: nn.Module, dtype: torch.dtype, copy_it: bool) -> Iterator[nn.Module]:
    """The model at `dtype` with every tensor on the meta device, for the measuring passes; the model itself after
    them as it was. A model already wholly on meta (a plan's) is converted in place and its tensors put back after:
    a deep copy of every module was most of a plan's time, paid once per plan of a serving load's search for its
    rows; any other, or with `copy_it` (a training pass, whose backward leaves gradients), is copied (`_meta_copy`)."""
    if copy_it or not all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        yield _meta_copy(model).to(dtype=dtype)
        return
    held = [(module, name, module._parameters[name].data) for module in model.modules() for name in module._parameters
            if module._parameters[name] is not None]
    buffers = [(module, dict(module._buffers)) for module in model.modules() if module._buffers]
    try:
        yield model.to(dtype=dtype)
    finally:
        for module, name, data in held:
            module._parameters[name].data = data
        for module, saved in buffers:
            module._buffers.update(saved)


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model's structure with every tensor on the meta device: nothing of a real model's weights is copied."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _structure(layer: nn.Module) -> tuple[Any, ...]:
    """What a layer's bytes on the meta device depend on beside its input: its modules, its weights' shapes and
    dtypes, and the attention kind some models vary by layer."""
    attention = getattr(layer, "self_attn", None)
    return (tuple((name, type(module)) for name, module in layer.named_modules()),
            tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters()),
            getattr(layer, "attention_type", None), getattr(attention, "sliding_window", None))


def _layers_prefix(units: list[str]) -> str:
    for unit in units:
        head, _, tail = unit.rpartition(".")
        if tail.isdigit() and head.endswith("layers"):
            return head + "."
    return "\0"


class _Recorder:
    """Transient peaks per unit (no_grad pass), or saved bytes per unit (grad pass, weights excluded)."""

    def __init__(self, out: dict[str, UnitRuntime], weights: set[int] | None, rows_factor: int) -> None:
        self.out, self.weights, self.factor = out, weights, rows_factor
        self.live = _LiveBytes()
        self.current: list[str] = []
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []
        self.start_of: dict[str, int] = {}  # live bytes when a unit's forward began (module hooks)

    def enter(self, unit: str) -> None:
        self.current.append(unit)
        self.start_of[unit] = self.live.start()

    def leave(self, unit: str) -> None:
        self.current.pop()
        base = self.start_of.pop(unit, 0)
        if self.weights is None and unit in self.out:
            self.out[unit].transient = max(self.out[unit].transient, self.live.peak - base)

    def around(self, unit: str, call: Callable[[], Any]) -> Any:
        self.enter(unit)
        try:
            return call()
        finally:
            self.leave(unit)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        root = tensor._base if tensor._base is not None else tensor
        if self.current and id(root) not in self.weights and id(root) not in self.seen:  # type: ignore[operator]
            self.seen.add(id(root))
            self.kept.append(root)  # alive as backward would keep it (and its id is never reused)
            self.out[self.current[-1]].saved += root.numel() * root.element_size() * self.factor
        return tensor


def _run(recorder: _Recorder, body: Callable[[], None]) -> None:
    """`body` under the recorder: live bytes (no grad), or saved tensors (grad). Attention runs as a GPU's fused
    kernel (flash or memory-efficient) allocates: its output only, never the score matrix the meta device's math
    fallback would make; for backward it keeps its inputs and its output."""

    def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                        **kwargs: Any) -> torch.Tensor:
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        if recorder.weights is not None:
            for tensor in (query, key, value, out):
                recorder.pack(tensor)
        return out

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused_attention):
        if recorder.weights is None:
            with recorder.live:
                body()
            return
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            body()


def _measure_causal(model: nn.Module, workload: Workload, out: dict[str, UnitRuntime],
                    saved: set[int] | None) -> None:
    """One micro-batch (lane, joining pack) of prompts through the layers one by one, as devmap's stages call
    them. A decoder layer of the same modules and weight shapes as two measured before it (every layer of a LLaMA)
    takes the second one's bytes instead of running (the first also counts what the layers share): a plan costs two
    layers' runs, not all of them, and a serving plan searches its rows over many plans."""
    recorder = _Recorder(out, saved, workload.chunks)
    base, rows, length = model.model, workload.prefill_batch, workload.seq_len
    prefix = next((n for n, m in model.named_modules() if m is base), "model")

    def body() -> None:
        ids = torch.zeros(rows, length, dtype=torch.long, device="meta")
        hidden = recorder.around(f"{prefix}.embed_tokens", lambda: base.embed_tokens(ids))
        positions = torch.arange(length, device="meta").expand(rows, length)
        context = {"attention_mask": None, "position_ids": positions,
                   "position_embeddings": base.rotary_emb(hidden, positions)}
        keyword = cache_keyword(base.layers[0])
        measured: dict[Any, str] = {}  # a layer's structure -> the layer measured for it
        first: set[Any] = set()  # the first of a structure also saves what later layers share (positions): run two
        for i, layer in enumerate(base.layers):
            unit, structure = f"{prefix}.layers.{i}", _structure(layer)
            twin = measured.get(structure)
            if twin is not None:  # the same modules and shapes on the same input: the same bytes
                out[unit].transient, out[unit].saved = out[twin].transient, out[twin].saved
                continue
            shape = hidden.shape
            hidden = recorder.around(unit,
                                     lambda layer=layer, h=hidden: call_decoder_layer(layer, h, None, context, keyword))
            if unit in out and hidden.shape == shape and structure in first:  # output shaped as its input
                measured[structure] = unit
            first.add(structure)
        hidden = recorder.around(f"{prefix}.norm", lambda: base.norm(hidden))
        last = hidden[:, -1:] if workload.kind in ("generate", "serve") else hidden  # generation's head: last token
        recorder.around("lm_head", lambda: model.lm_head(last).float())

    _run(recorder, body)


def _measure_vision(model: nn.Module, workload: Workload, out: dict[str, UnitRuntime],
                    saved: set[int] | None) -> None:
    """One micro-batch through the model, each unit's forward attributed by module hooks."""
    recorder = _Recorder(out, saved, workload.chunks)
    handles = []
    for unit in out:
        module = model.get_submodule(unit) if unit else model
        handles.append(module.register_forward_hook(_hook(recorder, unit), with_kwargs=False))
        handles.append(module.register_forward_pre_hook(_pre_hook(recorder, unit)))
    try:
        x = torch.zeros((workload.micro_batch, *workload.input_shape), device="meta",
                        dtype=next(model.parameters()).dtype)
        _run(recorder, lambda: model(x))
    finally:
        for handle in handles:
            handle.remove()


def _pre_hook(recorder: _Recorder, unit: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        recorder.enter(unit)
    return hook


def _hook(recorder: _Recorder, unit: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        recorder.leave(unit)
    return hook
