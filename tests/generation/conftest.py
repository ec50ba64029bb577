"""A tiny LLaMA for the CPU generation tests (two stages come from split_layers)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

CONFIG = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _tiny_llama(attn_implementation: str | None = None, **overrides) -> torch.nn.Module:
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**CONFIG, **overrides}), **extra).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """A factory: tiny_llama(**config overrides, attn_implementation=...) -> a fresh random tiny LLaMA."""
    return _tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _tiny_llama()
