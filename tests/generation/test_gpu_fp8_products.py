"""GPU-only, one GPU with FP8 tensor cores: an fp8 LLaMA with joined projections decodes the greedy tokens of
torchao's own fp8 model."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.kernels.fp8_products import Fp8Weight
from devmap.loading.quantize import quantize_linears
from devmap.planning.quantization import parse_quantization
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


@pytest.fixture(autouse=True)
def fp8_cards():
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("fp8 needs a GPU of compute capability 8.9 and up")


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
    assert all(isinstance(w, Fp8Weight) for w in weights)
    ids = torch.randint(3, 500, (2, 12), device="cuda")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=12, eos_token_id=[]).cpu(), expected.cpu())


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 40])
@pytest.mark.parametrize("outs, ins", [(15360, 5120), (5120, 13824), (96, 208)])
def test_fp8_rows_products_agree_with_torchs_scaled_mm(rows, outs, ins):
    """devmap's kernel (decode rows) and `torch._scaled_mm` (past them) give torch's product of the same float8
    tokens and weights, within bfloat16's rounding of sums whose order differs."""
    from devmap.kernels.fp8_products import DECODE_ROWS, fp8_rows_product

    torch.manual_seed(rows)
    tokens = (torch.randn(rows, ins, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(rows, 1, device="cuda") + 0.5
    qdata = (torch.randn(outs, ins, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(outs, 1, device="cuda") + 0.5
    got = fp8_rows_product(tokens, scales, qdata, scale, False)
    want = torch._scaled_mm(tokens, qdata.t(), scale_a=scales, scale_b=scale.t(), out_dtype=torch.bfloat16)
    exact = (tokens.double() @ qdata.double().t()) * scales.double() * scale.t().double()
    assert got.shape == (rows, outs) and got.dtype == torch.bfloat16
    if rows > DECODE_ROWS:
        assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), exact, atol=1e-3 * exact.abs().max().item(), rtol=2 ** -7)
    torch.testing.assert_close(want.double(), exact, atol=1e-3 * exact.abs().max().item(), rtol=2 ** -7)
