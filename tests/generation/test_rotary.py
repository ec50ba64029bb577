"""devmap's rotary cos/sin (`generation.rotary.Rotary`) against transformers' rotary module, for the rope types whose
frequencies are fixed (computed by devmap) and those transformers updates as positions grow (the module's own), and
for every model family devmap generates with."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from devmap.generation.rotary import Rotary

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FIXED = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def _module(parameters: dict) -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(LlamaConfig(**SHAPE, rope_parameters=dict(parameters)))


@pytest.mark.parametrize("kind", sorted(FIXED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_frequencies_give_transformers_cos_and_sin(kind, dtype):
    module = _module(FIXED[kind])
    rotary = Rotary(module)
    assert rotary.frequencies is not None
    hidden = torch.randn(3, 5, 64, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [100, 101, 102, 103, 250]])
    ours, theirs = rotary(hidden, positions), type(module).forward(module, hidden, positions)
    for mine, reference in zip(ours, theirs):
        assert mine.dtype == dtype and torch.equal(mine, reference)


def test_frequencies_transformers_updates_go_through_its_module():
    module = _module({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    rotary = Rotary(module)
    assert rotary.frequencies is None
    hidden, positions = torch.randn(1, 4, 64), torch.arange(300, 304)[None]  # past the original length: updated
    ours, theirs = rotary(hidden, positions), type(module).forward(module, hidden, positions)
    assert all(torch.equal(mine, reference) for mine, reference in zip(ours, theirs))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_every_family_devmap_generates_with_gets_its_modules_cos_and_sin(family):
    import importlib

    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **SHAPE, head_dim=16)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    module = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("RotaryEmbedding"))(config)
    rotary = Rotary(module)
    assert rotary.frequencies is not None
    hidden, positions = torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.tensor([[0, 1, 2], [40, 41, 200]])
    ours, theirs = rotary(hidden, positions), type(module).forward(module, hidden, positions)
    assert all(torch.equal(mine, reference) for mine, reference in zip(ours, theirs))
