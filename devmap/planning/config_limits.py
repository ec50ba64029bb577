"""Sanity limits for a stranger's config.json: sizes checked and the model's bytes bounded before anything is built."""

from __future__ import annotations

from typing import Any

from ..errors import SourceError

# Building a meta model costs about a millisecond per layer; real models have at most a few hundred layers.
MAX_LAYERS = 512
# No machine holds 10^13 parameters (20 TB in bf16); refuse before building (or reading) anything that large.
MAX_PARAMS = 10**13
MAX_CONFIG_BYTES = 16 * 2**20
# Integer fields that size a model; each must be a whole number >= 1 (or >= 0 where zero means "none").
_SIZE_FIELDS = {
    "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "vocab_size": 1, "max_position_embeddings": 1, "head_dim": 1,
    "n_embd": 1, "n_layer": 1, "n_head": 1, "n_inner": 1, "n_positions": 1, "num_layers": 1, "d_model": 1,
    "num_local_experts": 0, "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
    "num_classes": 1,
}
_MAX_POSITIONS = 2**27  # some models build position tables of this length


def check_config(raw: dict[str, Any], where: str) -> int:
    """Refuse non-integer, negative or absurd sizes in `raw` (nested configs too); return a lower bound on
    the parameter count (0 when the config names too little to tell), so callers can refuse what cannot fit."""
    bound = 0
    for config in _configs(raw):
        for key, least in _SIZE_FIELDS.items():
            if config.get(key) is None:
                continue
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SourceError(f"{where}: {key} is {value!r}, but it must be a whole number >= {least}")
        layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
        if layers > MAX_LAYERS:
            raise SourceError(
                f"{where}: {layers:,} layers is absurd (devmap builds at most {MAX_LAYERS:,}; real models have "
                "a few hundred at most); fix num_hidden_layers"
            )
        positions = _first(config, "max_position_embeddings", "n_positions")
        if positions > _MAX_POSITIONS:
            raise SourceError(f"{where}: max_position_embeddings {positions:,} is absurd (at most {_MAX_POSITIONS:,})")
        bound = max(bound, _params_lower_bound(config))
    if bound > MAX_PARAMS:
        raise SourceError(
            f"{where}: these sizes make at least {bound:.2e} parameters, which no machine holds "
            f"(devmap stops at {MAX_PARAMS:.0e}); fix hidden_size, intermediate_size, num_hidden_layers or vocab_size"
        )
    return bound


def _params_lower_bound(config: dict[str, Any]) -> int:
    """Embeddings plus, per layer, two hidden x hidden attention projections and two hidden x intermediate MLP
    matrices: every decoder of this shape has at least these (so a refusal built on it is never wrong)."""
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _first(config, "vocab_size")
    inner = _first(config, "intermediate_size", "n_inner")
    classes = _first(config, "num_classes")
    return vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * inner) + classes


def _first(config: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _configs(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The config and every nested sub-config (text_config, vision_config, ...)."""
    found, stack = [], [raw]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(v for v in node.values() if isinstance(v, dict))
    return found
