"""GPU-only, one GPU: int4 weights taken from torchao's (tinygemm's layout) and nf4 ones from bitsandbytes' into
devmap's plain layout stand for the same numbers, devmap's kernels give the library's products at every row count, and
a 4-bit LLaMA with joined projections decodes the greedy tokens of the library's own model."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.kernels.four_bit_linear import FourBitLinear, four_bit_weight, own_four_bit_linears
from devmap.kernels.four_bit_layout import dequantize
from devmap.kernels.four_bit_products import kernel_applies, product
from devmap.loading.quantize import quantize_linears
from devmap.planning.quantization import parse_quantization
from devmap.testing import require_gpus
from test_four_bit_products import NF4  # noqa: E402  (this folder is on the path: no package)

pytestmark = require_gpus(1)
LIBRARY = {"int4": "torchao", "nf4": "bitsandbytes"}


def library_linear(outs: int, ins: int, scheme: str) -> nn.Module:
    holder = nn.Module()
    holder.linear = nn.Linear(ins, outs, bias=False, device="cuda", dtype=torch.bfloat16)
    quantize_linears(holder, ["linear"], parse_quantization(scheme))
    return holder.linear


@pytest.mark.parametrize("scheme", ["int4", "nf4"])
def test_devmaps_layout_gives_the_librarys_products_at_every_row_count(scheme):
    pytest.importorskip(LIBRARY[scheme])
    torch.manual_seed(0)
    for outs, ins in ((384, 1024), (5120, 13824), (13824, 5120)):  # 13,824: tinygemm pads it to 14,336
        linear = library_linear(outs, ins, scheme)
        weight = four_bit_weight(linear)
        assert weight is not None and weight.shape == (outs, ins)
        eye = torch.eye(ins, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            library_values = linear(eye).t().float()
        # the same numbers, up to bf16's rounding of each value (and, nf4, of each block's absmax)
        torch.testing.assert_close(dequantize(weight, torch.float32), library_values, atol=1e-6, rtol=1e-2)
        assert weight.affine == (scheme == "int4") and weight.group == (128 if scheme == "int4" else 64)
        assert (weight.zero is None) == (scheme == "nf4")  # nf4 has no zeros
        for rows in (1, 5, 32, 33, 128, 129, 2100):  # one block, tiles, values + cuBLAS
            x = torch.randn(rows, ins, device="cuda", dtype=torch.bfloat16)
            assert kernel_applies(x, weight)
            with torch.no_grad():
                want = linear(x).float()
            got = product(x, weight).float()
            assert ((got - want).norm() / want.norm()).item() < 5e-3, (scheme, outs, ins, rows)
        del linear, weight, eye
        torch.cuda.empty_cache()


def plain_model(model: nn.Module) -> nn.Module:
    """A copy of the model with each FourBitLinear a plain Linear of the numbers it stands for."""
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, FourBitLinear):
                linear = nn.Linear(module.in_features, module.out_features, bias=False, device="cuda",
                                   dtype=torch.bfloat16)
                linear.weight.data.copy_(dequantize(module.four_bit, torch.bfloat16))
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent), attr, linear)
    return plain


@pytest.mark.parametrize("scheme", ["int4", "nf4"])
def test_a_four_bit_llama_decodes_the_librarys_greedy_tokens(scheme):
    pytest.importorskip(LIBRARY[scheme])
    from devmap import generate
    from devmap.generation.joined_projections import join_projections, joined_products

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    names = [n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]
    quantize_linears(model.model.layers, names, parse_quantization(scheme))
    reference = copy.deepcopy(model)
    assert join_projections(model) == 2 * config.num_hidden_layers
    assert own_four_bit_linears(model) == 0  # already taken
    assert all(isinstance(m, FourBitLinear) for n, m in model.model.layers.named_modules() if n.endswith("_proj"))
    assert len([p for p in joined_products(model) if p.quantized is not None]) == 4 * config.num_hidden_layers
    ids = torch.randint(3, 500, (2, 12), device="cuda")
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
    error = ((got - want).norm() / want.norm()).item()
    assert error < 1e-2, error
    if scheme == "nf4":  # the same numbers as bitsandbytes' but for rounding (its table and absmax in bfloat16):
        reference = plain_model(model)  # greedy tokens of the plain model whose weights are those numbers
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=12, eos_token_id=[]).cpu(), expected.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_rows_kernels_bit_patterns_give_the_dequantized_product(dtype):
    """Both half-precision dtypes' PTX (`decode_ptx`: int4's bit patterns and a table's), every block shape of the
    rule, against the product of the weights made in float32: within a last bit of each weight."""
    from devmap.kernels.four_bit_layout import quantize_int4
    from devmap.kernels.four_bit_products import kernel_product, dequantized
    from devmap.kernels.four_bit_products_kernel import decode_ptx

    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(320, 512, device="cuda", dtype=dtype), group=64)
    assert decode_ptx(dtype, weight) and not decode_ptx(torch.float32, weight)
    assert torch.equal(dequantized(weight, dtype), dequantize(weight, dtype))  # past TILED_ROWS: float32, then rounded
    nf4 = weight._replace(code_values=NF4, zero=None)  # a table and no zeros: nf4's PTX, no zeros read
    zeros = nf4._replace(zero=weight.zero)  # a table with zeros
    assert decode_ptx(dtype, nf4) != decode_ptx(dtype, weight)
    assert torch.equal(dequantized(nf4, dtype), dequantize(nf4, dtype))
    assert torch.equal(dequantized(zeros, dtype), dequantize(zeros, dtype))
    for rows in (1, 9, 16, 17, 32, 33, 100, 130, 256):
        x = torch.randn(rows, 512, device="cuda", dtype=dtype)
        for four_bit in (weight, nf4, zeros):
            want = x.float() @ dequantize(four_bit, dtype).float().t()
            got = kernel_product(x, four_bit).float()
            assert ((got - want).norm() / want.norm()).item() < 2e-3, (dtype, rows, four_bit.affine)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hoppers_kernel_gives_the_dequantized_product(dtype):
    """On an sm_90 GPU, steps of 33-256 rows run `four_bit_products_wgmma`: int4 and a table, groups of 64 and 128,
    output columns that end mid-block, tiles of 64, 128 and 256 rows and tiles in two parts (96, 160, 192 rows), one
    share and several, against the product of the weights made in float32, and what `product` picks equals
    it."""
    from devmap.kernels.four_bit_layout import quantize_int4
    from devmap.kernels.four_bit_products import wgmma_decode_ptx
    from devmap.kernels.four_bit_products_kernel import decode_ptx
    from devmap.kernels.four_bit_products_wgmma import WgmmaShape, wgmma_product, wgmma_shape

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper's kernel runs on sm_90 only")
    torch.manual_seed(0)
    for outs, ins, group in ((320, 1024, 64), (200, 1536, 128)):
        weight = quantize_int4(torch.randn(outs, ins, device="cuda", dtype=dtype), group=group)
        nf4 = weight._replace(code_values=NF4, zero=None)
        for rows in (33, 64, 70, 100, 130, 180, 200, 256):
            x = torch.randn(rows, ins, device="cuda", dtype=dtype)
            for four_bit in (weight, nf4):
                ptx = decode_ptx(dtype, four_bit)
                assert ptx and wgmma_decode_ptx(x, four_bit) == ptx
                want = x.float() @ dequantize(four_bit, dtype).float().t()
                rule = wgmma_shape(rows, outs, ins // four_bit.span, four_bit.span, not four_bit.affine)
                for shape in (rule, rule._replace(splits=1), WgmmaShape(rule.rows, 64, 2, 3, rule.tail),
                              WgmmaShape(rule.rows, 128, 2, 1, rule.tail)):
                    got = wgmma_product(x, four_bit, ptx, shape).float()
                    error = ((got - want).norm() / want.norm()).item()
                    assert error < 2e-3, (dtype, outs, group, rows, four_bit.affine, shape)
                assert torch.equal(product(x, four_bit), wgmma_product(x, four_bit, ptx))
    unaligned = weight._replace(packed=weight.packed[:, :-8])
    assert not wgmma_decode_ptx(x[:, 1:], unaligned)  # TMA: rows not 16-byte aligned
