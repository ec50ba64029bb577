"""DEVMAP_STREAM_CHECK's settings and poison (the checks themselves run on GPUs:
tests/generation/test_gpu_streams.py)."""

import pytest
import torch

from devmap.pipelining.streams import CHECK_DEFAULT_CYCLES, check_cycles, poison


@pytest.mark.parametrize("value, cycles", [("", 0), ("0", 0), ("1", CHECK_DEFAULT_CYCLES), ("5000", 5000)])
def test_check_cycles_follow_the_variable(monkeypatch, value, cycles):
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", value)
    assert check_cycles() == cycles


def test_poison_leaves_nothing_readable():
    floats, ids = torch.ones(3), torch.arange(3)
    poison(floats)
    poison(ids)
    assert torch.isnan(floats).all() and (ids == -1).all()


def test_generate_with_checks_on_a_cpu_gives_the_same_tokens(monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from devmap import generate

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         vocab_size=64)).eval()
    ids = torch.randint(3, 64, (4, 6))
    plain = generate(model, ids, max_new_tokens=5, lanes=3, split_layers=[2], eos_token_id=[])
    monkeypatch.setenv("DEVMAP_STREAM_CHECK", "1")
    assert torch.equal(generate(model, ids, max_new_tokens=5, lanes=3, split_layers=[2], eos_token_id=[]), plain)
