"""GPU-only, one GPU: int8 products with a scale per output row (`--quantize int8`'s weights) through the Triton
kernels against the plain computation (up to DECODE_ROWS rows as they are, more quantized per token), and an int8
half-precision model with joined projections decoding the greedy tokens of torchao's weight-only model made to
quantize each token of a product of more than DECODE_ROWS rows (captured steps, continuous batches)."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from devmap.kernels import int8_products
from devmap.kernels.int8_products import DECODE_ROWS, Int8Weight, kernel_applies, product
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_products_equal_the_plain_product(dtype):
    torch.manual_seed(0)
    # the decode kernel (up to DECODE_ROWS rows), then int8 tokens (both tile heights, uneven tiles, > 2,048 rows)
    for rows, outs, ins in ((1, 5120, 5120), (2, 15360, 5120), (32, 27648, 512), (64, 640, 13824), (7, 100, 300),
                            (65, 5120, 5120), (300, 1000, 700), (2100, 27648, 512), (1024, 5120, 13824)):
        x = torch.randn(rows, ins, device="cuda", dtype=dtype)
        weight = torch.randn(outs, ins, device="cuda")
        scale = weight.abs().amax(1, keepdim=True) / 127
        qdata = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        assert kernel_applies(x, Int8Weight(qdata, scale))
        if rows <= DECODE_ROWS:
            want = (x.float() @ qdata.float().t()) * scale.t()
        else:
            token_scale = x.float().abs().amax(1, keepdim=True) / 127
            want = ((x.float() / token_scale).round() @ qdata.float().t()) * token_scale * scale.t()
        torch.testing.assert_close(product(x, Int8Weight(qdata, scale)).float(), want, atol=5e-2, rtol=2e-2)
    assert not kernel_applies(x.float(), Int8Weight(qdata, scale))  # float32: torchao's formula


def test_int8_tokens_products_do_not_depend_on_the_other_rows():
    """Past DECODE_ROWS each row is quantized on its own and summed exactly: a row's product has the same bits in a
    product of any other rows (past DECODE_ROWS)."""
    torch.manual_seed(0)
    for outs, ins in ((15360, 5120), (5120, 13824), (1000, 300)):
        x = torch.randn(2100, ins, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(outs, ins, device="cuda")
        scale = weight.abs().amax(1, keepdim=True) / 127
        qdata = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        every = product(x, Int8Weight(qdata, scale))
        for begin, end in ((0, 65), (30, 200), (1000, 2100), (2000, 2100)):
            assert torch.equal(product(x[begin:end], Int8Weight(qdata, scale)), every[begin:end])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tokens_round_as_torch_for_every_value_of_the_dtype(dtype):
    """A token's int8 (x · 1/scale corrected by its residual, rounded half to even) equals torch's
    `(x / scale).round()` for every finite value of the dtype as the row's max and every value up to it: exhaustive
    (~10⁹ pairs), then the kernel against torch itself on rows with exact halves."""
    from devmap.kernels.int8_products_kernel import SMALLEST_NORMAL, quantize_rows_kernel

    from int8_rounding_check import rounding_mismatches_kernel  # beside this file (pytest puts its folder on the path)

    bits = torch.arange(1, 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = bits[torch.isfinite(bits)].float().cuda()  # ascending: the positive patterns in order
    mismatches = torch.zeros(values.numel(), dtype=torch.int32, device="cuda")
    rounding_mismatches_kernel[(values.numel(), -(-values.numel() // 1024))](
        values, mismatches, values.numel(), BLOCK=1024, RECIPROCAL_FROM=SMALLEST_NORMAL)
    wrong = mismatches.nonzero().flatten()
    assert wrong.numel() == 0, f"{int(mismatches.sum())} mismatches, row maxima {values[wrong[:8]].tolist()}"
    torch.manual_seed(0)
    x = torch.randn(64, 5120, device="cuda", dtype=dtype) * 3
    x[::2, :64] = torch.arange(-32, 32, device="cuda", dtype=dtype) + 0.5  # scale 1 in these rows: exact halves
    x[::2, 64] = 127
    x[1, :] = 0  # an all-zero row: scale 1
    wide = torch.cat([x, torch.randn(64, 15000, device="cuda", dtype=dtype)], 1)  # rows read twice (70B's down)
    wide[1, :] = 0
    for rows, block, one_pass in ((x, 8192, True), (wide, 1024, False)):
        quantized = torch.empty(rows.shape, dtype=torch.int8, device="cuda")
        scales = torch.empty(64, device="cuda")
        quantize_rows_kernel[(64,)](rows, quantized, scales, rows.shape[1], rows.stride(0), BLOCK=block,
                                    ONE_PASS=one_pass, RECIPROCAL_FROM=SMALLEST_NORMAL, num_warps=8)
        want_scales = rows.float().abs().amax(1) / 127
        want_scales[1] = 1
        assert torch.equal(scales, want_scales)
        assert torch.equal(quantized, (rows.float() / want_scales[:, None]).round().to(torch.int8))


def int8_tokens_past_decode_rows(linear: nn.Module) -> None:
    """Make a torchao int8 Linear quantize each token of a product of more than DECODE_ROWS rows, as devmap does,
    in plain float32 arithmetic (the reference)."""
    from devmap.compat import torchao_int8_parts

    qdata, scale, _ = torchao_int8_parts(linear.weight)
    weight_only = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0] <= DECODE_ROWS:
            return weight_only(x)
        token_scale = rows.abs().amax(1, keepdim=True) / 127
        out = ((rows / token_scale).round() @ qdata.float().t()) * token_scale * scale.float().reshape(1, -1)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    linear.forward = forward


def test_int8_half_precision_model_decodes_torchaos_greedy_tokens(monkeypatch, run_continuous,
                                                                 requests_and_their_tokens):
    from torchao.quantization import Int8WeightOnlyConfig

    from devmap import generate
    from devmap.compat import torchao_int8_rows
    from devmap.generation.joined_projections import join_projections

    calls = []
    kernel, tokens_kernel = int8_products.kernel_product, int8_products.tokens_product
    monkeypatch.setattr(int8_products, "kernel_product", lambda *a: calls.append("rows") or kernel(*a))
    monkeypatch.setattr(int8_products, "tokens_product", lambda *a: calls.append("tokens") or tokens_kernel(*a))
    torch.manual_seed(21)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float16).to("cuda:0").eval()
    with torch.no_grad():
        reference.lm_head.weight.mul_(30)  # wide margins between the best tokens (half-precision rounding)
    linears = [m for layer in reference.model.layers for m in layer.modules() if type(m) is nn.Linear]
    torchao_int8_rows(linears, Int8WeightOnlyConfig(set_inductor_config=False))
    joined = copy.deepcopy(reference)
    for linear in linears:
        int8_tokens_past_decode_rows(linear)
    assert join_projections(joined) == 2 * config.num_hidden_layers
    # prompts of up to 7 tokens join four at most: weight-only products (up to DECODE_ROWS rows), as alone
    reqs, tokens = requests_and_their_tokens(reference, 23, 8, 8, 10)
    ids = torch.randint(3, 1000, (4, 8), device="cuda:0")
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    # a prefill of 160 rows: int8 tokens. Quantizing a token is discontinuous (a last-bit difference upstream can move
    # an element by one step), so against the reference only the first new token is asserted; devmap's own paths
    # (eager, captured, compiled) must agree on every token
    long_ids = torch.randint(3, 1000, (4, 40), device="cuda:0")
    first = reference.generate(long_ids, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None).cpu()
    long_tokens = generate(joined, long_ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(long_tokens[:, :41], first)
    for compile in (False, True):  # the kernel in captured eager steps, and inside torch.compile's graphs
        for _ in range(2):  # run (and compile), then capture and replay
            assert torch.equal(generate(joined, ids, max_new_tokens=12, eos_token_id=[], compile=compile), expected)
            assert torch.equal(generate(joined, long_ids, max_new_tokens=12, eos_token_id=[], compile=compile),
                               long_tokens)
            got, left, _ = run_continuous(joined, reqs[:3], reqs[3:], rows=4, first_slot=32, cache_len=48,
                                          compile=compile)
            assert not left and got == tokens
    assert set(calls) == {"rows", "tokens"}
