"""fp8 weights (torchao's float8 weights with a scale per output row, activations quantized per token) join like int8
ones: a layer's query/key/value and gate/up data and scales end to end, the Linear modules' weights torchao's float8
weights over views of them; decode steps over them give torchao's greedy tokens. Their products go to gemlite below
`GEMV_ROWS` rows where it is installed (a GPU) and to torchao's float8 Linear elsewhere (the CPU here: torchao's
product runs on it, gemlite does not)."""

import copy

import pytest
import torch
from torch import nn

from devmap import generate
from devmap.generation.causal_lm import CausalLMStages
from devmap.generation.joined_projections import JoinedLayer, join_projections, joined_products
from devmap.kernels import fp8_products
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


def test_fp8_projections_join_their_data_and_scales_and_decode_torchaos_tokens(model, monkeypatch):
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
    assert layer.qkv.quantized.gemlite is None  # off a GPU: torchao's product
    assert layer.qkv.quantized.shape == (attention.q_proj.out_features + 2 * attention.k_proj.out_features,
                                         attention.q_proj.in_features)
    assert len(CausalLMStages(clone).joined) == len(model.model.layers)
    ids = torch.randint(3, 500, (2, 9))
    torch.testing.assert_close(clone(ids).logits, quantized(ids).logits, rtol=0, atol=0)  # torchao's forward
    expected = quantized.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(clone, ids, max_new_tokens=10, split_layers=[2], eos_token_id=[]), expected)


class FakeGemlite:
    """Stands for gemlite's Linear: records the rows it multiplies, returns torchao's product."""

    def __init__(self, library):
        self.library, self.rows = library, []

    def __call__(self, x):
        self.rows.append(x.numel() // x.shape[-1])
        return nn.functional.linear(x, self.library)


def test_products_go_to_gemlite_below_gemv_rows_and_to_torchao_from_there(model, monkeypatch):
    clone = fp8_copy(model, monkeypatch)
    join_projections(clone)
    weight = JoinedLayer.of(clone.model.layers[0], "llama").qkv.quantized
    fake = FakeGemlite(weight.library)
    weight.gemlite = fake
    for rows in (1, 5, fp8_products.GEMV_ROWS - 1, fp8_products.GEMV_ROWS, 3 * fp8_products.GEMV_ROWS):
        x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)
        torch.testing.assert_close(fp8_products.product(x, weight), nn.functional.linear(x, weight.library))
    assert fake.rows == [1, 5, fp8_products.GEMV_ROWS - 1]
    fake.rows.clear()
    fp8_products.product(torch.randn(2, 3, weight.shape[1]), weight)  # float32 input: torchao's
    assert fake.rows == []


def test_gemlite_products_are_prepared_once_per_weight_shape_at_every_row_count_below_gemv_rows(model, monkeypatch):
    clone = fp8_copy(model, monkeypatch)
    join_projections(clone)
    weights = [p.quantized for p in joined_products(clone)]
    assert len(weights) == 4 * len(model.model.layers) and all(isinstance(w, Fp8Weight) for w in weights)
    assert fp8_products.prepare_kernels(weights, torch.bfloat16) == 0  # no gemlite off a GPU
    fakes = []
    for weight in weights:
        weight.gemlite = FakeGemlite(weight.library)
        fakes.append(weight.gemlite)
    shapes = {tuple(w.shape) for w in weights}
    assert fp8_products.prepare_kernels(weights, torch.bfloat16) == len(shapes) * (fp8_products.GEMV_ROWS - 1)
    assert sorted(rows for fake in fakes for rows in fake.rows) == sorted(
        list(range(1, fp8_products.GEMV_ROWS)) * len(shapes))


def test_fp8_joined_steps_compile_once_for_every_batch_size(model, monkeypatch, compiles_once_for_every_batch_size,
                                                           compiled_on_cpu):
    """A compiled continuous batch of fp8 joined layers (aot_eager: inductor's tracing and guards) traces torchao's
    float8 product whole and never guards on its rows below `GEMV_ROWS`, and gives the eager batch's tokens."""
    clone = fp8_copy(model, monkeypatch)
    join_projections(clone)
    compiles_once_for_every_batch_size(clone, compiled_on_cpu)
