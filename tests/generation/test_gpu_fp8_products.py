"""GPU-only, one GPU with FP8 tensor cores: fp8 products through gemlite give torchao's products at every decode row
count, and an fp8 LLaMA with joined projections decodes the greedy tokens of torchao's own fp8 model."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.kernels import fp8_products
from devmap.kernels.fp8_products import Fp8Weight
from devmap.loading.quantize import quantize_linears
from devmap.planning.quantization import parse_quantization
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


@pytest.fixture(autouse=True)
def fp8_cards():
    pytest.importorskip("torchao")
    pytest.importorskip("gemlite")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("fp8 needs a GPU of compute capability 8.9 and up")


def fp8_linear(outs: int, ins: int) -> nn.Module:
    holder = nn.Module()
    holder.linear = nn.Linear(ins, outs, bias=False, device="cuda", dtype=torch.bfloat16)
    quantize_linears(holder, ["linear"], parse_quantization("fp8"))
    return holder.linear


def test_gemlites_products_are_torchaos_at_every_decode_row_count():
    torch.manual_seed(0)
    for outs, ins in ((384, 1024), (15360, 5120), (5120, 13824)):
        linear = fp8_linear(outs, ins)
        weight = Fp8Weight.of(linear.weight.qdata, linear.weight.scale, linear.weight)
        assert weight.gemlite is not None
        assert fp8_products.prepare_kernels([weight], torch.bfloat16) == fp8_products.GEMV_ROWS - 1
        for rows in (1, 2, 3, 16, 31, 32, fp8_products.GEMV_ROWS - 1, fp8_products.GEMV_ROWS, 200):
            x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
            assert fp8_products.kernel_applies(x, weight) == (rows < fp8_products.GEMV_ROWS)
            with torch.no_grad():
                got, want = fp8_products.product(x, weight).float(), linear(x).float()
            error = ((got - want).norm() / want.norm()).item()
            assert error < 1e-2, (outs, ins, rows, error)


def test_an_fp8_llama_with_joined_projections_decodes_torchaos_greedy_tokens():
    from devmap import generate
    from devmap.generation.joined_projections import join_projections, joined_products

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    names = [n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]
    quantize_linears(model.model.layers, names, parse_quantization("fp8"))
    reference = copy.deepcopy(model)
    assert join_projections(model) == 2 * config.num_hidden_layers
    weights = [p.quantized for p in joined_products(model)]
    assert len(weights) == 4 * config.num_hidden_layers
    assert all(isinstance(w, Fp8Weight) and w.gemlite is not None for w in weights)
    fp8_products.prepare_kernels(weights, torch.bfloat16)
    ids = torch.randint(3, 500, (2, 12), device="cuda")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=12, eos_token_id=[]).cpu(), expected.cpu())
