"""One matrix product for the projections of a LLaMA decoder layer that read the same input: the attention's query,
key and value, and the MLP's gate and up. A decode step of one or a few rows is bound by reading weights, and five
products of a layer become two (fewer launches, each long enough to reach the memory's pace).

`join_projections(model)` stores each group's weights end to end in one buffer; the Linear modules keep their
weights, as views into it (no second copy; transformers' own forward and the weights' values are unchanged).
A model whose weights share buffers this way must not be saved with safetensors, which refuses shared memory: the
serving engine, which owns its models and never saves them, joins them at load. `JoinedLayer.of` finds such buffers
in any model, and devmap's stages run such layers (prefills and decode steps) on them; layers it finds none in run
transformers' own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..compat import attention_function, own_forward

JOINED_MODEL_TYPES = ("llama",)  # whose decoder layer `JoinedLayer.__call__` redoes (qwen3 adds norms of q and k,
# mistral and qwen2 pass sliding windows to their attention)


def join_projections(model: nn.Module) -> int:
    """Store each LLaMA decoder layer's query, key and value weights (and biases) end to end in one buffer, and its
    gate and up weights in another, the Linear modules' parameters becoming views into them. Layers whose
    projections are not plain Linear modules on one device in one dtype (quantized, offloaded) stay as they are.
    Returns the groups joined (two per layer at most)."""
    if getattr(model.config, "model_type", None) not in JOINED_MODEL_TYPES:
        return 0
    joined = 0
    for layer in model.model.layers:
        for group in _groups(layer):
            if _joinable(group) and _joined_weight(group) is None and _join(group):
                joined += 1
    return joined


def _groups(layer: nn.Module) -> list[tuple[nn.Module, ...]]:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    groups = []
    if attention is not None and all(hasattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        groups.append((attention.q_proj, attention.k_proj, attention.v_proj))
    if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        groups.append((mlp.gate_proj, mlp.up_proj))
    return groups


def _joinable(group: Sequence[nn.Module]) -> bool:
    """Plain Linear modules over one input size, their weights plain tensors on one real device in one dtype, all
    with biases or none."""
    if any(type(linear) is not nn.Linear for linear in group):
        return False
    weights = [linear.weight for linear in group]
    first = weights[0]
    return (all(type(w.data) is torch.Tensor and w.device == first.device and w.dtype == first.dtype
                and w.shape[1] == first.shape[1] and w.is_contiguous() for w in weights)
            and first.device.type != "meta" and len({linear.bias is None for linear in group}) == 1)


@torch.no_grad()
def _join(group: Sequence[nn.Module]) -> bool:
    """Join the group's weights (and biases); False, the group left as it was, when its device has no room for the
    joined buffer beside the parts for a moment."""
    names = [name for name in ("weight", "bias") if getattr(group[0], name) is not None]
    try:
        buffers = {name: torch.cat([getattr(linear, name).detach() for linear in group]) for name in names}
    except torch.OutOfMemoryError:
        return False
    for name, buffer in buffers.items():
        begin = 0
        for linear in group:
            part = getattr(linear, name)
            end = begin + part.shape[0]
            setattr(linear, name, nn.Parameter(buffer[begin:end], requires_grad=part.requires_grad))
            begin = end
    return True


def _joined_weight(group: Sequence[nn.Module], name: str = "weight") -> torch.Tensor | None:
    """The group's `name` tensors as one (a view of the buffer they lie in end to end), or None when they don't."""
    parts = [getattr(linear, name, None) for linear in group]
    if any(p is None or not isinstance(p, torch.Tensor) or type(p.data) is not torch.Tensor for p in parts):
        return None
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not part.is_contiguous()
                or part.storage_offset() != offset or part.shape[1:] != first.shape[1:]
                or part.dtype != first.dtype):
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@dataclass
class JoinedLayer:
    """A LLaMA decoder layer's joined projections (see `join_projections`), and its forward over them."""

    layer: nn.Module
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: list[int]
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    gate_up_sizes: list[int]

    @classmethod
    def of(cls, layer: nn.Module, model_type: str | None) -> JoinedLayer | None:
        """The layer's joined projections, or None when its weights are not joined (or it is no LLaMA layer)."""
        if model_type not in JOINED_MODEL_TYPES:
            return None
        groups = _groups(layer)
        if len(groups) != 2:
            return None
        (attention_group, mlp_group) = groups
        qkv, gate_up = _joined_weight(attention_group), _joined_weight(mlp_group)
        if qkv is None or gate_up is None:
            return None
        biases = [_joined_weight(g, "bias") if g[0].bias is not None else None for g in groups]
        if any(b is None and g[0].bias is not None for b, g in zip(biases, groups)):
            return None
        return cls(layer, qkv, biases[0], [p.weight.shape[0] for p in attention_group],
                   gate_up, biases[1], [p.weight.shape[0] for p in mlp_group])

    def __call__(self, hidden: torch.Tensor, cache: Any, context: dict[str, Any]) -> torch.Tensor:
        """The layer's forward as transformers' `LlamaDecoderLayer` computes it, with two products for its five
        input projections (`cache`: None, or transformers' `Cache.update` protocol); `context` holds the mask and
        the rotary cos/sin (`position_embeddings`)."""
        layer = self.layer
        attention, mlp = layer.self_attn, layer.mlp
        normed = own_forward(layer.input_layernorm)(hidden)
        shape = (*normed.shape[:-1], -1, attention.head_dim)
        query, key, value = (part.view(shape).transpose(1, 2)
                             for part in F.linear(normed, self.qkv, self.qkv_bias).split(self.qkv_sizes, dim=-1))
        cos, sin = context["position_embeddings"]
        query, key = _rotated(query, cos, sin), _rotated(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx)
        out, _ = attention_function(attention.config)(attention, query, key, value, context["attention_mask"],
                                                      dropout=0.0, scaling=attention.scaling)
        hidden = hidden + own_forward(attention.o_proj)(out.reshape(*normed.shape[:-1], -1).contiguous())
        normed = own_forward(layer.post_attention_layernorm)(hidden)
        gate, up = F.linear(normed, self.gate_up, self.gate_up_bias).split(self.gate_up_sizes, dim=-1)
        return hidden + own_forward(mlp.down_proj)(mlp.act_fn(gate) * up)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `x` (rows × heads × tokens × dim) as transformers' LLaMA applies it."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
