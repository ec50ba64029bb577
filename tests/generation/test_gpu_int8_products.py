"""GPU-only, one GPU: int8 products with a scale per output row (`--quantize int8`'s weights) through the Triton
kernel against the plain computation, and an int8 half-precision model with joined projections decoding torchao's
greedy tokens (captured steps, continuous batches)."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.generation import int8_products
from devmap.generation.int8_products import KERNEL_ROWS, int8_product, kernel_applies
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_products_equal_the_plain_product(dtype):
    torch.manual_seed(0)
    # decode kernel, tiled kernel (64- and 256-row tiles, the most rows)
    for rows, outs, ins in ((1, 5120, 5120), (2, 15360, 5120), (32, 27648, 512), (64, 640, 13824), (7, 100, 300),
                            (65, 5120, 5120), (300, 1000, 700), (2048, 27648, 512), (1024, 5120, 13824)):
        x = torch.randn(rows, ins, device="cuda", dtype=dtype)
        weight = torch.randn(outs, ins, device="cuda")
        scale = weight.abs().amax(1, keepdim=True) / 127
        qdata = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        assert kernel_applies(x, qdata, scale)
        want = (x.float() @ qdata.float().t()) * scale.t()
        torch.testing.assert_close(int8_product(x, qdata, scale).float(), want, atol=5e-2, rtol=2e-2)
    assert not kernel_applies(x.float(), qdata, scale)  # float32: torchao's formula
    x = torch.randn(KERNEL_ROWS + 1, 300, device="cuda", dtype=dtype)  # past KERNEL_ROWS: torchao's formula
    assert not kernel_applies(x, qdata, scale)


def test_int8_half_precision_model_decodes_torchaos_greedy_tokens(monkeypatch, run_continuous,
                                                                 requests_and_their_tokens):
    from torchao.quantization import Int8WeightOnlyConfig

    from devmap import generate
    from devmap.compat import torchao_int8_rows
    from devmap.generation.joined_projections import join_projections

    calls = []
    kernel = int8_products.kernel_product
    monkeypatch.setattr(int8_products, "kernel_product", lambda *a: calls.append(1) or kernel(*a))
    torch.manual_seed(21)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float16).to("cuda:0").eval()
    with torch.no_grad():
        reference.lm_head.weight.mul_(30)  # wide margins between the best tokens (half-precision rounding)
    linears = [m for layer in reference.model.layers for m in layer.modules() if type(m) is nn.Linear]
    torchao_int8_rows(linears, Int8WeightOnlyConfig(set_inductor_config=False))
    joined = copy.deepcopy(reference)
    assert join_projections(joined) == 2 * config.num_hidden_layers
    reqs, tokens = requests_and_their_tokens(reference, 23, 8, 30, 10)
    ids = torch.randint(3, 1000, (4, 12), device="cuda:0")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    for compile in (False, True):  # the kernel in captured eager steps, and inside torch.compile's graphs
        for _ in range(2):  # run (and compile), then capture and replay
            assert torch.equal(generate(joined, ids, max_new_tokens=12, eos_token_id=[], compile=compile), expected)
            got, left, _ = run_continuous(joined, reqs[:3], reqs[3:], rows=4, first_slot=32, cache_len=48,
                                          compile=compile)
            assert not left and got == tokens
    assert calls
