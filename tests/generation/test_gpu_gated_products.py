"""GPU-only, one GPU: the gated products (`kernels.gated`) on the card's own conversions: the fp8 and int8 gated
kernels against torch's formula over the same products, the fp8 down product quantizing from the row maxima against
torchao's tokens, and LLaMA models wide enough to gate (8,192 gate and up outputs) decoding the greedy tokens of
torchao's own fp8 and int8 models."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.testing import require_gpus

pytestmark = require_gpus(1)


@pytest.fixture
def torchao():
    return pytest.importorskip("torchao")


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 40])
def test_fp8_gated_rows_and_their_down_product_match_torch_and_torchao(rows, torchao):
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("fp8 needs a GPU of compute capability 8.9 and up")
    from devmap.compat import torchao_fp8_tokens_of
    from devmap.kernels.fp8_products import fp8_gated_rows_product, fp8_maxes_rows_product, fp8_rows_product
    from devmap.kernels.gated import gated_by_torch, row_maxes

    torch.manual_seed(rows)
    size, ins, outs = 13824, 5120, 5120
    tokens = (torch.randn(rows, ins, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(rows, 1, device="cuda") * 1e-3 + 1e-4
    qdata = (torch.randn(2 * size, ins, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2 * size, 1, device="cuda") * 1e-3 + 1e-4
    h, maxes = fp8_gated_rows_product(tokens, scales, qdata, scale, False)
    want = gated_by_torch(fp8_rows_product(tokens, scales, qdata, scale, False))
    assert h.shape == (rows, size) and h.dtype == torch.bfloat16
    print("DIAG fp8 rows", rows, (h != want).sum().item(), (h.float() - want.float()).abs().max().item())
    torch.testing.assert_close(h.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=2 ** -6)
    assert torch.equal(maxes, row_maxes(h))
    down = (torch.randn(outs, size, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    down_scale = torch.rand(outs, 1, device="cuda") * 1e-3
    got = fp8_maxes_rows_product(h, maxes, down, down_scale, False, None, None)
    quantized, token_scales = torchao_fp8_tokens_of(h, h.abs().amax(1, keepdim=True).float(), None, None)
    assert torch.equal(got, fp8_rows_product(quantized, token_scales, down, down_scale, False))  # torchao's tokens


@pytest.mark.parametrize("rows", [1, 16, 32, 33])
def test_int8_gated_rows_match_torchs_formula(rows):
    from devmap.kernels.gated import gated_by_torch
    from devmap.kernels.int8_products import int8_gated_rows_product, int8_rows_product

    torch.manual_seed(rows)
    size, ins = 13824, 5120
    x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
    qdata = torch.randint(-127, 128, (2 * size, ins), dtype=torch.int8, device="cuda")
    scale = torch.rand(2 * size, 1, device="cuda") * 1e-3
    got = int8_gated_rows_product(x, qdata, scale)
    want = gated_by_torch(int8_rows_product(x, qdata, scale))
    print("DIAG int8 rows", rows, (got != want).sum().item(), (got.float() - want.float()).abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=2 ** -6)


def _wide_llama(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=256, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # wide margins between the best tokens
    return model


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_wide_quantized_llamas_gate_their_feed_forward_and_decode_torchaos_greedy_tokens(scheme, torchao):
    from devmap import generate
    from devmap.generation.joined_projections import JoinedLayer, join_projections
    from devmap.loading.quantize import quantize_linears
    from devmap.planning.quantization import parse_quantization

    if scheme == "fp8" and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("fp8 needs a GPU of compute capability 8.9 and up")
    model = _wide_llama(torch.bfloat16)
    names = [n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]
    quantize_linears(model.model.layers, names, parse_quantization(scheme))
    reference = copy.deepcopy(model)
    assert join_projections(model) == 8
    assert all(JoinedLayer.of(layer, "llama").gated for layer in model.model.layers)
    ids = torch.randint(3, 500, (3, 12), device="cuda")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate(model, ids, max_new_tokens=12, eos_token_id=[]).cpu()
    import devmap.generation.joined_projections as joined_projections
    joined_projections.gated_applies, kept = (lambda *a: False), joined_projections.gated_applies
    try:
        ungated = generate(model, ids, max_new_tokens=12, eos_token_id=[]).cpu()
    finally:
        joined_projections.gated_applies = kept
    print("DIAG", scheme, (got != expected.cpu()).sum().item(), (ungated != expected.cpu()).sum().item(),
          (got != ungated).sum().item())
    assert torch.equal(got, ungated)  # the gate in the kernel: the module's own operations' bits
