"""Both families of devmap's quantized products answer one protocol (`kernels.quantized_products`): a weight of
either kind is multiplied, and its kernels prepared, through the same calls, by its own family."""

import torch

from devmap.kernels import four_bit_products, int8_products
from devmap.kernels.four_bit_layout import dequantize, quantize_int4
from devmap.kernels.int8_products import Int8Weight
from devmap.kernels.quantized_products import ProductFamily, family, prepare_kernels, product


def int8_weight(outs: int, ins: int) -> Int8Weight:
    weight = torch.randn(outs, ins)
    scale = weight.abs().amax(1, keepdim=True) / 127
    return Int8Weight((weight / scale).round().clamp(-128, 127).to(torch.int8), scale)


def test_each_family_implements_the_protocol():
    for module in (int8_products, four_bit_products):
        assert all(callable(getattr(module, name)) for name in ("kernel_applies", "product", "prepare_kernels"))
        assert module.KERNEL_DTYPES == (torch.float16, torch.bfloat16)
    checked: ProductFamily = int8_products  # the modules are the protocol's implementations  # noqa: F841


def test_a_weight_is_multiplied_by_its_own_family():
    torch.manual_seed(0)
    x, bias = torch.randn(3, 128), torch.randn(48)
    int8, four_bit = int8_weight(48, 128), quantize_int4(torch.randn(48, 128), group=64)
    assert family(int8) is int8_products and family(four_bit) is four_bit_products
    torch.testing.assert_close(product(x, int8, bias), x @ (int8.qdata.float() * int8.scale).t() + bias)
    torch.testing.assert_close(product(x, four_bit), x @ dequantize(four_bit, torch.float32).t())
    assert prepare_kernels([int8, four_bit, int8], torch.float32) == 0  # the CPU: no kernel applies
