"""A LLaMA model's module tree on the meta device, built from its config's values alone, for plans of its weights.

Planning where a LLaMA checkpoint's weights go needs only the names, shapes and dtypes of its tensors, which
parameters are tied and which blocks stay whole; it does not run the model. Building transformers' own
`LlamaForCausalLM` for that imports transformers, which in a fresh process costs more than everything else a plan
does (its configuration classes import its image and video utilities, torchvision and torch's compiler stack).
This tree has transformers' module names, class names, parameter and buffer shapes, its tied head and its blocks
that stay whole, so accelerate places it exactly as it places transformers' model (a test compares the two on
every preset and config variant, for every strategy); it has no forward. Plans that run the model on the meta
device (runtime memory, the per-layer table) build transformers' model instead (`ModelSource.build`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import SourceError

# config.json fields that size a LLaMA model, and the transformers defaults of those a config may leave out.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_DEFAULTS: dict[str, Any] = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


class Linear(nn.Linear):
    """torch's Linear, its parameters left uninitialized (initializing meta tensors imports torch's compiler)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """torch's Embedding, its weight left uninitialized."""

    def reset_parameters(self) -> None:
        pass


class LlamaRMSNorm(nn.Module):
    """The weight of a LLaMA RMS norm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))


class LlamaRotaryEmbedding(nn.Module):
    """Rotary frequencies: buffers no checkpoint holds, kept in float32 whatever the model's dtype."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("original_inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_fn = nn.SiLU()


class LlamaDecoderLayer(nn.Module):
    def __init__(self, sizes: dict[str, Any]) -> None:
        super().__init__()
        hidden = sizes["hidden_size"]
        self.self_attn = LlamaAttention(hidden, sizes["num_attention_heads"], sizes["num_key_value_heads"],
                                        sizes["head_dim"], sizes["attention_bias"])
        self.mlp = LlamaMLP(hidden, sizes["intermediate_size"], sizes["mlp_bias"])
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)


class LlamaModel(nn.Module):
    def __init__(self, sizes: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(sizes["vocab_size"], sizes["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(sizes) for _ in range(sizes["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(sizes["hidden_size"])
        self.rotary_emb = LlamaRotaryEmbedding(sizes["head_dim"])


class LlamaForCausalLM(nn.Module):
    """The root of the layout: transformers' names, and its `_no_split_modules` (the decoder layers stay whole)."""

    _no_split_modules = ["LlamaDecoderLayer"]
    devmap_layout = True  # a tree to place, not a model to run

    def __init__(self, sizes: dict[str, Any], config_of: Callable[[], Any]) -> None:
        super().__init__()
        self._config_of = config_of
        self.model = LlamaModel(sizes)
        self.lm_head = Linear(sizes["hidden_size"], sizes["vocab_size"], bias=False)
        if sizes["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def config(self) -> Any:
        """transformers' config of the model, as its own model has it (read on first use)."""
        return self._config_of()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a LLaMA layout places weights and does not run: build the model with ModelSource.build")


def is_layout(model: nn.Module) -> bool:
    """Whether `model` is a layout (placed, never run)."""
    return bool(getattr(model, "devmap_layout", False))


def names_every_size(settings: dict[str, Any]) -> bool:
    """Whether `settings` names every size a layout is built from (else transformers' defaults would fill them in,
    and its own model is the one to plan)."""
    return all(isinstance(settings.get(key), int) for key in _REQUIRED)


def layout_sizes(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """The sizes a layout is built from, with transformers' defaults and derivations where `settings` (config.json's
    values, sizes already checked as whole numbers by `check_config`) leaves them out; a config that does not name
    every size, or whose heads do not divide its hidden size, is refused in one line."""
    missing = [key for key in _REQUIRED if not isinstance(settings.get(key), int)]
    if missing:
        raise SourceError(f"{where} has no {', '.join(missing)}: a LLaMA config.json names each of them")
    sizes = {key: settings[key] for key in _REQUIRED}
    heads = sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = settings.get("num_key_value_heads") or heads
    head_dim = settings.get("head_dim")
    if head_dim is None:  # as transformers' LlamaConfig derives it, and refuses
        if sizes["hidden_size"] % heads:
            raise SourceError(f"{where}: hidden_size {sizes['hidden_size']} is not a multiple of num_attention_heads "
                              f"{heads}; give head_dim, or fix the sizes")
        head_dim = sizes["hidden_size"] // heads
    sizes["head_dim"] = head_dim
    for key, default in _DEFAULTS.items():
        value = settings.get(key, default)
        sizes[key] = default if value is None else bool(value)
    return sizes


def build_layout(settings: dict[str, Any], where: str, config_of: Callable[[], Any]) -> nn.Module:
    """The layout of the LLaMA model `settings` describes, on the meta device, its parameters in float32 (as
    `ModelSource.build` builds transformers' model: the plan sizes them at its own dtype); `config_of` gives its
    `config` (transformers', read only when asked for)."""
    sizes = layout_sizes(settings, where)
    with torch.device("meta"):
        return LlamaForCausalLM(sizes, config_of).eval()
