"""A feed-forward gated in its gate/up product (`kernels.gated`): the gated kernels (fp8, int8) give the torch
formula's silu(gate) · up and, for fp8, each program's row maxima, from which the down product quantizes its tokens
exactly as torchao's formula does (Triton's interpreter, on the CPU); joined LLaMA layers wide enough gate there, and
off GPUs the gated path is the module's own operations."""

import copy
import textwrap

import pytest
import torch

from devmap.generation.joined_projections import JoinedLayer, join_projections
from devmap.kernels.gated import gated_applies, row_maxes

GATED_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from devmap.compat import torchao_fp8_tokens_of
    from devmap.kernels.fp8_products import fp8_gated_rows_product, tokens_from_maxes
    from devmap.kernels.gated import gated_by_torch, row_maxes
    from devmap.kernels.int8_products import int8_gated_rows_product

    torch.manual_seed(0)
    # one row and up to DECODE_ROWS; sizes HALF divides and ones it does not; inner dimensions the block does not
    for rows, size, ins in ((1, 96, 200), (5, 8200, 130), (17, 64, 256), (32, 130, 64)):
        tokens = (torch.randn(rows, ins) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(rows, 1) * 0.01 + 0.005
        qdata = (torch.randn(2 * size, ins) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(2 * size, 1) * 0.001 + 0.0005
        h, maxes = fp8_gated_rows_product(tokens, scales, qdata, scale, False)
        want = gated_by_torch(((tokens.float() @ qdata.float().t()) * scales * scale.t()).bfloat16())
        assert h.shape == (rows, size) and h.dtype == torch.bfloat16 and maxes.shape == (-(-size // 64), rows)
        # the interpreter's half-precision conversions truncate, and silu(g) · u far below zero moves with g's last bit
        torch.testing.assert_close(h.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=2 ** -6)
        assert torch.equal(maxes, row_maxes(h))
        # the down product's tokens, made from the maxima: torchao's float8 tokens and scales, bit for bit
        tokens8, scales8 = tokens_from_maxes(h, maxes)
        quantized, token_scales = torchao_fp8_tokens_of(h, h.abs().amax(1, keepdim=True).float(), None, None)
        assert torch.equal(tokens8.view(torch.uint8), quantized.view(torch.uint8))
        assert torch.equal(scales8, token_scales)
        x = torch.randn(rows, ins, dtype=torch.float16)
        q8 = torch.randint(-127, 128, (2 * size, ins), dtype=torch.int8)
        s8 = (torch.rand(2 * size) * 0.01).half()
        want8 = gated_by_torch((torch.mm(x.float(), q8.float().t()) * s8.float()).half())
        got8 = int8_gated_rows_product(x, q8, s8)
        torch.testing.assert_close(got8.float(), want8.float(), atol=1e-2 * want8.abs().max().item(), rtol=2 ** -6)
    print("gated ok")
""")


def test_gated_kernels_give_the_torch_formula_and_torchaos_tokens_in_tritons_interpreter(tritons_interpreter):
    pytest.importorskip("torchao")
    done = tritons_interpreter(GATED_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gated ok" in done.stdout


def test_row_maxes_cover_each_half_block_of_columns():
    h = torch.zeros(2, 130, dtype=torch.bfloat16)
    h[0, 3], h[0, 70], h[1, 129], h[1, 0] = -5, 2, 7, 0.5
    assert torch.equal(row_maxes(h), torch.tensor([[5.0, 0.5], [2.0, 0.0], [0.0, 7.0]]))


def test_gated_products_apply_to_wide_silu_gate_and_up_pairs_only():
    assert gated_applies(8192, [4096, 4096], "silu", None)
    assert not gated_applies(8190, [4095, 4095], "silu", None)  # cut along the inner dimension
    assert not gated_applies(9000, [4000, 5000], "silu", None)
    assert not gated_applies(8192, [4096, 4096], "gelu", None)
    assert not gated_applies(8192, [4096, 4096], "silu", torch.zeros(8192))


def test_wide_int8_layers_gate_their_feed_forward_and_decode_torchaos_tokens(tiny_llama):
    """A layer whose gate and up make 8,192 outputs gates in its product; off GPUs that is the module's own
    operations, torchao's logits to the bit."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from torch import nn

    from devmap.compat import torchao_int8_rows

    torch.manual_seed(0)
    model = tiny_llama(intermediate_size=4096, num_hidden_layers=2)
    linears = [m for layer in model.model.layers for m in layer.modules() if type(m) is nn.Linear]
    torchao_int8_rows(linears, Int8WeightOnlyConfig(set_inductor_config=False))
    joined = copy.deepcopy(model)
    assert join_projections(joined) == 4
    assert all(JoinedLayer.of(layer, "llama").gated for layer in joined.model.layers)
    narrow = tiny_llama(num_hidden_layers=1)
    join_projections(narrow)
    assert not JoinedLayer.of(narrow.model.layers[0], "llama").gated  # bfloat16/float32 weights: cuBLAS's products
    ids = torch.randint(3, 500, (2, 9))
    torch.testing.assert_close(joined(ids).logits, model(ids).logits, rtol=0, atol=0)
