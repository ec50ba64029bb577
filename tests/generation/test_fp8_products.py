"""fp8 weights (torchao's float8 weights with a scale per output row, activations quantized per token) join like int8
ones: a layer's query/key/value and gate/up data and scales end to end, the Linear modules' weights torchao's float8
weights over views of them; decode steps over them, eager and compiled, give torchao's greedy tokens where torch's
CPU product takes a scale per row (torch 2.12 and later; 2.11's CPU `_scaled_mm` takes one scale per tensor)."""

import copy
import textwrap

import pytest
import torch
from torch import nn

from devmap import generate
from devmap.compat import stored_tensors
from devmap.generation.causal_lm import CausalLMStages
from devmap.generation.joined_projections import JoinedLayer, join_projections, joined_products
from devmap.kernels import quantized_products
from devmap.kernels.fp8_products import Fp8Weight

pytest.importorskip("torchao")


def fp8_copy(model, monkeypatch):
    """The model in bfloat16 with every decoder layer's Linear weights quantized as --quantize fp8 does (torchao's
    config; its check for FP8 tensor cores waived: torchao's float8 product runs on the CPU too)."""
    import torchao.quantization.quant_api as quant_api

    from devmap.loading.quantize import quantize_linears
    from devmap.planning.quantization import parse_quantization

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    clone = copy.deepcopy(model).to(torch.bfloat16)
    names = [n for n, m in clone.model.layers.named_modules() if type(m) is nn.Linear]
    quantize_linears(clone.model.layers, names, parse_quantization("fp8"))
    return clone


def products_on_this_cpu(weight) -> None:
    """Skip where torch's CPU float8 product takes one scale per tensor only (torch 2.11)."""
    try:
        nn.functional.linear(torch.zeros(1, weight.shape[1], dtype=torch.bfloat16), weight)
    except RuntimeError as exc:
        if "per-tensor scaling" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__}'s CPU float8 product takes one scale per tensor")


def test_fp8_projections_join_their_data_and_scales(model, monkeypatch):
    quantized = fp8_copy(model, monkeypatch)
    clone = copy.deepcopy(quantized)
    assert join_projections(clone) == 2 * len(model.model.layers)
    attention = clone.model.layers[0].self_attn
    assert type(attention.q_proj.weight).__name__ == "Float8Tensor"
    assert len({p.weight.qdata.untyped_storage().data_ptr()
                for p in (attention.q_proj, attention.k_proj, attention.v_proj)}) == 1
    assert len({p.weight.scale.untyped_storage().data_ptr()
                for p in (attention.q_proj, attention.k_proj, attention.v_proj)}) == 1
    layer = JoinedLayer.of(clone.model.layers[0], "llama")
    assert isinstance(layer.qkv.quantized, Fp8Weight) and isinstance(layer.down.quantized, Fp8Weight)
    assert layer.qkv.quantized.shape == (attention.q_proj.out_features + 2 * attention.k_proj.out_features,
                                         attention.q_proj.in_features)
    assert len(CausalLMStages(clone).joined) == len(model.model.layers)
    weights = [p.quantized for p in joined_products(clone)]
    assert len(weights) == 4 * len(model.model.layers) and all(isinstance(w, Fp8Weight) for w in weights)
    assert quantized_products.prepare_kernels(weights, torch.bfloat16) == 0  # on a CPU no kernel of devmap's applies
    joined_state = clone.state_dict()
    for name, value in quantized.state_dict().items():  # the same numbers: float8 data and scales, as views
        assert all(torch.equal(a, b) for a, b in zip(stored_tensors(joined_state[name]), stored_tensors(value))), name


def test_fp8_joined_layers_decode_torchaos_tokens(model, monkeypatch):
    quantized = fp8_copy(model, monkeypatch)
    products_on_this_cpu(quantized.model.layers[0].self_attn.q_proj.weight)
    clone = copy.deepcopy(quantized)
    join_projections(clone)
    ids = torch.randint(3, 500, (2, 9))
    torch.testing.assert_close(clone(ids).logits, quantized(ids).logits, rtol=0, atol=0)  # torchao's forward
    expected = quantized.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(clone, ids, max_new_tokens=10, split_layers=[2], eos_token_id=[]), expected)


def test_fp8_joined_steps_compile_once_for_every_batch_size(model, monkeypatch, compiles_once_for_every_batch_size,
                                                           compiled_on_cpu):
    """A compiled continuous batch of fp8 joined layers (aot_eager: inductor's tracing and guards) traces torchao's
    float8 product whole and never guards on its rows below `GEMV_ROWS`, and gives the eager batch's tokens."""
    clone = fp8_copy(model, monkeypatch)
    products_on_this_cpu(clone.model.layers[0].self_attn.q_proj.weight)
    join_projections(clone)
    compiles_once_for_every_batch_size(clone, compiled_on_cpu)


FP8_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from devmap.kernels.fp8_products import kernel_product

    torch.manual_seed(0)
    # the decode kernel's block shapes: narrow products split in 4 parts, wide ones (8,192 outputs and more) not;
    # inner dimensions the block divides and ones it does not
    for rows, outs, ins in ((1, 96, 200), (5, 64, 256), (16, 40, 300), (3, 8200, 130), (24, 72, 160), (32, 8200, 64)):
        tokens = (torch.randn(rows, ins) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(rows, 1) + 0.5
        qdata = (torch.randn(outs, ins) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(outs, 1) + 0.5
        got = kernel_product(tokens, scales, qdata, scale)
        want = (tokens.float() @ qdata.float().t()) * scales * scale.t()
        assert got.shape == (rows, outs) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=0, rtol=2 ** -7)
    print("kernel ok")
""")


def test_fp8_kernel_equals_the_exact_product_in_tritons_interpreter(tritons_interpreter):
    done = tritons_interpreter(FP8_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel ok" in done.stdout


def test_fp8_products_off_gpus_are_torchaos_linear(model, monkeypatch):
    """Where no kernel applies (here: the CPU) the product is torchao's float8 Linear itself."""
    from devmap.kernels import fp8_products

    quantized = fp8_copy(model, monkeypatch)
    clone = copy.deepcopy(quantized)
    join_projections(clone)
    weight = JoinedLayer.of(clone.model.layers[0], "llama").qkv.quantized
    x = torch.randn(3, weight.shape[1], dtype=torch.bfloat16)
    assert not fp8_products.kernel_applies(x, weight)
    calls = []
    monkeypatch.setattr(fp8_products.F, "linear", lambda *args: calls.append(args[1]) or torch.zeros(3))
    fp8_products.product(x, weight)
    assert calls == [weight.library]
