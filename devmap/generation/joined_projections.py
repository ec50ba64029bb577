"""One matrix product for the projections of a LLaMA decoder layer that read the same input: the attention's query,
key and value, and the MLP's gate and up. A decode step of one or a few rows is bound by reading weights, and five
products of a layer become two (fewer launches, each long enough to reach the memory's pace).

`join_projections(model)` stores each group's weights end to end in one buffer (for int8 and float8 weights with a
scale per output row, their data and their scales, each in one buffer); the Linear modules keep their weights, as views
into it (no second copy; transformers' own forward and the weights' values are unchanged). A model whose weights
share buffers this way must not be saved with safetensors, which refuses shared memory: the serving engine, which
owns its models and never saves them, joins them at load. `JoinedLayer.of` finds such buffers in any model, and
devmap's stages run such layers (prefills and decode steps) on them, int8, 4-bit and fp8 products through
`kernels.quantized_products` (torchao's int4 and bitsandbytes' nf4 Linear layers are first taken into devmap's
layout: `four_bit_linear`); layers it finds none in run transformers' own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..compat import (attention_function, own_forward, torchao_fp8_parts, torchao_fp8_weight, torchao_int8_parts,
                      torchao_int8_weight)
from ..loading.tensor_layers import RowParallelLinear
from ..kernels.four_bit_linear import FourBitLinear, own_four_bit_linears
from ..kernels.four_bit_layout import FourBitWeight
from ..kernels.fp8_products import Fp8Weight
from ..kernels.int8_products import Int8Weight
from ..kernels.quantized_products import QuantizedWeight, product

JOINED_MODEL_TYPES = ("llama",)  # whose decoder layer `JoinedLayer.__call__` redoes (qwen3 adds norms of q and k,
# mistral and qwen2 pass sliding windows to their attention)


def join_projections(model: nn.Module) -> int:
    """Store each LLaMA decoder layer's query, key and value weights (and biases) end to end in one buffer, and its
    gate and up weights in another, the Linear modules' parameters becoming views into them. Full-precision weights,
    torchao's int8 and float8 weights with one scale per output row and 4-bit ones (torchao's int4 and bitsandbytes'
    nf4, on GPUs, first swapped for `FourBitLinear` modules of the same numbers) are joined; others (bitsandbytes'
    int8, offloaded, mixed) stay as they are, as does a group whose device has no room for the joined buffer for a
    moment. Returns the groups joined (two per layer at most)."""
    if getattr(model.config, "model_type", None) not in JOINED_MODEL_TYPES:
        return 0
    own_four_bit_linears(model)
    joined = 0
    for layer in model.model.layers:
        for group in _groups(layer):
            if _joinable(group) and Product.of(group) is None and _join(group):
                joined += 1
    return joined


def joined_layers(model: nn.Module) -> list[JoinedLayer | None]:
    """`JoinedLayer.of` each decoder layer of the model, in order (None for a layer not joined; [] for a model
    without decoder layers)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return [JoinedLayer.of(layer, model_type) for layer in getattr(getattr(model, "model", None), "layers", [])]


def every_layer_joined(model: nn.Module) -> bool:
    """Whether the model has decoder layers and every one is joined (then devmap's products run all of their
    projections)."""
    layers = joined_layers(model)
    return bool(layers) and all(joined is not None for joined in layers)


def joined_products(model: nn.Module) -> list[Product]:
    """Every product of the model's joined layers, in layer order (int8 weights: `qdata`, 4-bit: `four_bit`)."""
    return [p for joined in joined_layers(model) if joined is not None
            for p in (joined.qkv, joined.out, joined.gate_up, joined.down)]


def _groups(layer: nn.Module) -> list[tuple[nn.Module, ...]]:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    groups = []
    if attention is not None and all(hasattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        groups.append((attention.q_proj, attention.k_proj, attention.v_proj))
    if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        groups.append((mlp.gate_proj, mlp.up_proj))
    return groups


def _stored(linear: nn.Module) -> list[torch.Tensor] | None:
    """The plain tensors a Linear's weight is stored as: [weight] (full precision), [int8 data, scales] (and the
    zero point when it has one), [float8 data, scales] or, for a FourBitLinear, [packed codes, scales] (and zeros where
    it has them); None for a weight of any other form."""
    if isinstance(linear, FourBitLinear):
        return [linear.packed, linear.scale] + ([] if linear.zero is None else [linear.zero])
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if type(weight.data) is torch.Tensor:
        return [weight.data]
    fp8 = torchao_fp8_parts(weight)
    if fp8 is not None:
        return list(fp8)
    parts = torchao_int8_parts(weight)
    if parts is None:
        return None
    qdata, scale, zero_point = parts
    return [qdata, scale] if zero_point is None else [qdata, scale, zero_point]


def _joinable(group: Sequence[nn.Module]) -> bool:
    """Plain Linear modules (or FourBitLinear ones) over one input size, their weights stored the same way (full
    precision, int8 or 4-bit of the same code values) in contiguous tensors on one real device, all with biases or
    none."""
    kinds = {type(linear) for linear in group}
    if len(kinds) != 1 or not kinds <= {nn.Linear, FourBitLinear}:
        return False
    if len({getattr(linear, "code_values", None) for linear in group}) != 1:  # 4-bit: int4's and nf4's never join
        return False
    stored = [_stored(linear) for linear in group]
    if any(parts is None for parts in stored):
        return False
    first = stored[0]
    return (first[0].device.type != "meta" and len({linear.bias is None for linear in group}) == 1
            and all(len(parts) == len(first) and all(
                p.device == f.device and p.dtype == f.dtype and p.shape[1:] == f.shape[1:] and p.is_contiguous()
                for p, f in zip(parts, first)) for parts in stored)
            and all(linear.in_features == group[0].in_features for linear in group))


@torch.no_grad()
def _join(group: Sequence[nn.Module]) -> bool:
    """Join the group's weights (and biases); False, the group left as it was, when its device has no room for the
    joined buffers beside the parts for a moment."""
    stored = [_stored(linear) for linear in group]
    biases = [linear.bias for linear in group]
    try:
        buffers = [torch.cat([parts[i] for parts in stored]) for i in range(len(stored[0]))]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    except torch.OutOfMemoryError:
        return False
    begin = 0
    for linear, parts in zip(group, stored):
        end = begin + parts[0].shape[0]
        views = [buffer[begin:end] for buffer in buffers]
        if isinstance(linear, FourBitLinear):
            linear.packed, linear.scale, linear.zero = (views + [None])[:3]
        else:
            weight = views[0] if len(views) == 1 else _quantized_weight(views, linear.weight)
            linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[begin:end], requires_grad=linear.bias.requires_grad)
        begin = end
    return True


def _quantized_weight(views: list[torch.Tensor], like: Any) -> Any:
    """The library's quantized weight over `views` of joined buffers, with `like`'s settings: float8 or int8."""
    if views[0].dtype == torch.float8_e4m3fn:
        return torchao_fp8_weight(views[0], views[1], like)
    return torchao_int8_weight(views[0], views[1], (views + [None])[2], like)


def _end_to_end(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """`parts` as one tensor (a view of the buffer they lie in end to end, in order), or None when they don't."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not part.is_contiguous()
                or part.storage_offset() != offset or part.shape[1:] != first.shape[1:]
                or part.dtype != first.dtype):
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@dataclass
class Product:
    """A product of a layer's input with one or more Linear modules' weights lying end to end in one buffer:
    full-precision (`weight`) or quantized (`quantized`: int8 with a scale per output row, or devmap's 4-bit
    layout), and the biases if any."""

    weight: torch.Tensor | None
    quantized: QuantizedWeight | None
    bias: torch.Tensor | None
    sizes: list[int]  # each module's output size, in order

    @classmethod
    def of(cls, group: Sequence[nn.Module]) -> Product | None:
        """The group's product, or None when its weights (or biases) do not lie end to end in one buffer each."""
        stored = [_stored(linear) for linear in group]
        if any(parts is None for parts in stored) or len({len(parts) for parts in stored}) != 1:
            return None
        joined = [_end_to_end([parts[i].detach() for parts in stored]) for i in range(len(stored[0]))]
        bias = None
        if group[0].bias is not None:
            if any(linear.bias is None for linear in group):
                return None
            bias = _end_to_end([linear.bias.detach() for linear in group])
            if bias is None:
                return None
        if any(part is None for part in joined):
            return None
        sizes = [parts[0].shape[0] for parts in stored]
        if isinstance(group[0], FourBitLinear):
            return cls(None, FourBitWeight(*(joined + [None])[:3], group[0].code_values), bias, sizes)
        if len(joined) == 1:
            return cls(joined[0], None, bias, sizes)
        if joined[0].dtype == torch.float8_e4m3fn:
            return cls(None, Fp8Weight.of(joined[0], joined[1], group[0].weight), bias, sizes)
        return cls(None, Int8Weight(joined[0], joined[1]), bias, sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return product(x, self.quantized, self.bias)
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The product, cut into each module's output."""
        return self(x).split(self.sizes, dim=-1)


@dataclass
class JoinedLayer:
    """A LLaMA decoder layer's products over its joined projections (see `join_projections`), and its forward.

    `__call__` and `mixed` each spell the layer out whole, on purpose: with the attention and feed-forward halves as
    shared methods (the same operations), torch 2.11's dynamo guards on the cache's length and compiles the decode
    step again for every batch size (`test_*_compile_once*` catch it)."""

    layer: nn.Module
    qkv: Product
    out: Product
    gate_up: Product
    down: Product
    group: Any = None  # a tensor-parallel shard's process group: `out` and `down` give partial sums over it

    @classmethod
    def of(cls, layer: nn.Module, model_type: str | None) -> JoinedLayer | None:
        """The layer's products, or None when its weights are not joined (or it is no LLaMA layer)."""
        if model_type not in JOINED_MODEL_TYPES:
            return None
        groups = _groups(layer)
        if len(groups) != 2 or not all(_joinable(g) for g in groups):
            return None
        attention, mlp = layer.self_attn, layer.mlp
        products = [Product.of(g) for g in (groups[0], (attention.o_proj,), groups[1], (mlp.down_proj,))]
        if any(p is None for p in products) or any(type(m) not in (nn.Linear, FourBitLinear, RowParallelLinear)
                                                   for m in (attention.o_proj, mlp.down_proj)):
            return None
        return cls(layer, *products, group=getattr(attention.o_proj, "group", None))

    def __call__(self, hidden: torch.Tensor, cache: Any, context: dict[str, Any]) -> torch.Tensor:
        """The layer's forward as transformers' `LlamaDecoderLayer` computes it, with two products for its five
        input projections (`cache`: None, or transformers' `Cache.update` protocol); `context` holds the mask and
        the rotary cos/sin (`position_embeddings`)."""
        layer = self.layer
        attention, mlp = layer.self_attn, layer.mlp
        normed = own_forward(layer.input_layernorm)(hidden)
        shape = (*normed.shape[:-1], -1, attention.head_dim)
        query, key, value = (part.view(shape).transpose(1, 2) for part in self.qkv.split(normed))
        cos, sin = context["position_embeddings"]
        query, key = _rotated(query, cos, sin), _rotated(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx)
        out, _ = attention_function(attention.config)(attention, query, key, value, context["attention_mask"],
                                                      dropout=0.0, scaling=attention.scaling)
        hidden = hidden + self._summed(self.out(out.reshape(*normed.shape[:-1], -1).contiguous()))
        normed = own_forward(layer.post_attention_layernorm)(hidden)
        gate, up = self.gate_up.split(normed)
        return hidden + self._summed(self.down(mlp.act_fn(gate) * up))

    def mixed(self, hidden: torch.Tensor, rows: int, caches: tuple[Any, Any],
              contexts: tuple[dict[str, Any], dict[str, Any]]) -> torch.Tensor:
        """The layer over a decode step's rows and a pack of prompts at once: `hidden` is tokens × hidden size, the
        first `rows` one token per row (`caches[0]`, `contexts[0]`: the step's), the rest one pack of prompts end to
        end (`caches[1]`, `contexts[1]`: the pack's). Every product reads the weights once for both; only attention
        runs apart."""
        layer = self.layer
        attention, mlp = layer.self_attn, layer.mlp
        projected = self.qkv.split(own_forward(layer.input_layernorm)(hidden))
        outs = []
        # the step's rows as rows × 1 token, the pack as 1 row × its tokens
        for part, shape, cache, context in zip((slice(0, rows), slice(rows, None)),
                                               ((rows, 1), (1, hidden.shape[0] - rows)), caches, contexts):
            query, key, value = (p[part].reshape(*shape, -1, attention.head_dim).transpose(1, 2) for p in projected)
            cos, sin = context["position_embeddings"]
            query, key = _rotated(query, cos, sin), _rotated(key, cos, sin)
            key, value = cache.update(key, value, attention.layer_idx)
            out, _ = attention_function(attention.config)(attention, query, key, value, context["attention_mask"],
                                                          dropout=0.0, scaling=attention.scaling)
            outs.append(out.reshape(-1, out.shape[-2] * out.shape[-1]))
        hidden = hidden + self._summed(self.out(torch.cat(outs)))
        normed = own_forward(layer.post_attention_layernorm)(hidden)
        gate, up = self.gate_up.split(normed)
        return hidden + self._summed(self.down(mlp.act_fn(gate) * up))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's output: on a tensor-parallel shard its partial sum, added up over the group."""
        if self.group is not None:
            dist.all_reduce(partial, group=self.group)
        return partial


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `x` (rows × heads × tokens × dim) as transformers' LLaMA applies it."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
