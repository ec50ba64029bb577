"""Joined projections: a LLaMA layer's query/key/value and gate/up weights end to end in one buffer each (int8 data
and scales too), the Linear modules' weights views into them; decode steps over them give transformers' (and
torchao's) outputs and greedy tokens; the int8 product's kernel in Triton's interpreter."""

import copy
import textwrap

import pytest
import torch
from torch import nn

from devmap import generate
from devmap.generation import forward
from devmap.generation.causal_lm import CausalLMStages
from devmap.generation.continuous import SlotRequest
from devmap.generation.joined_projections import JoinedLayer, join_projections
from devmap.kernels.int8_products import Int8Weight


def joined_copy(model):
    clone = copy.deepcopy(model)
    assert join_projections(clone) == 2 * len(clone.model.layers)
    return clone


def test_joining_keeps_every_weight_and_shares_one_buffer_per_group(model):
    clone = joined_copy(model)
    for name, value in model.state_dict().items():
        assert torch.equal(clone.state_dict()[name], value), name
    attention = clone.model.layers[0].self_attn
    storages = {p.weight.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj, attention.v_proj)}
    assert len(storages) == 1
    assert join_projections(clone) == 0  # already joined
    ids = torch.randint(3, 500, (2, 9))
    torch.testing.assert_close(clone(ids).logits, model(ids).logits, rtol=0, atol=0)  # transformers' own forward
    torch.testing.assert_close(forward(clone, ids, split_layers=[2]), model(ids).logits)  # devmap's, joined


def test_a_group_without_room_to_join_stays_as_it_was(model, monkeypatch):
    clone = copy.deepcopy(model)
    weights = {name: p.data_ptr() for name, p in clone.named_parameters()}

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(torch, "cat", no_room)
    assert join_projections(clone) == 0
    assert {name: p.data_ptr() for name, p in clone.named_parameters()} == weights
    assert not CausalLMStages(clone).joined


def test_only_joined_sdpa_llama_layers_decode_joined(model, tiny_llama):
    assert not CausalLMStages(model).joined  # weights apart: transformers' forward
    assert len(CausalLMStages(joined_copy(model)).joined) == len(model.model.layers)
    eager = tiny_llama(attn_implementation="eager")
    join_projections(eager)
    assert not CausalLMStages(eager).joined  # eager attention keeps its float masks and transformers' layers
    quantized_like = joined_copy(model)
    quantized_like.model.layers[0].mlp.up_proj = nn.Linear(64, 160, bias=False)  # no longer in the buffer
    stages = CausalLMStages(quantized_like)
    assert id(quantized_like.model.layers[0]) not in stages.joined and len(stages.joined) == 3
    assert JoinedLayer.of(quantized_like.model.layers[1], "qwen3") is None


def test_a_joined_model_decodes_transformers_greedy_tokens(model, monkeypatch):
    clone = joined_copy(model)
    calls = []
    forward = JoinedLayer.__call__
    monkeypatch.setattr(JoinedLayer, "__call__", lambda self, *a: calls.append(1) or forward(self, *a))
    ids = torch.randint(3, 500, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    got = generate(clone, ids, attention_mask=mask, max_new_tokens=12, split_layers=[2], eos_token_id=[])
    assert torch.equal(got, expected)
    # the prompt's and every decode step's layers, of each lane
    assert calls and len(calls) % (12 * len(model.model.layers)) == 0


def test_projections_with_biases_join_with_their_biases(tiny_llama):
    torch.manual_seed(1)
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    clone = joined_copy(model)
    assert JoinedLayer.of(clone.model.layers[0], "llama").qkv.bias is not None
    ids = torch.randint(3, 500, (2, 6))
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(clone, ids, max_new_tokens=8, split_layers=[2], eos_token_id=[]), expected)


def test_a_joined_model_in_a_continuous_batch_gets_each_request_its_tokens(model, run_continuous):
    clone = joined_copy(model)
    g = torch.Generator().manual_seed(5)
    reqs = [SlotRequest(torch.randint(3, 500, (n,), generator=g).tolist(), m, f"r{i}")
            for i, (n, m) in enumerate([(5, 6), (9, 3), (3, 8), (11, 4), (7, 7)])]
    got, left, queue = run_continuous(clone, reqs[:2], reqs[2:], rows=3, first_slot=12, cache_len=30, lanes=1,
                                      split_layers=[2])
    assert not left and not queue
    for r in reqs:
        alone = model.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert got[r.owner] == alone[0, len(r.prompt):].tolist(), r.owner


def int8_copy(model):
    """The model with every decoder layer's Linear weights int8 with a scale per output row, as --quantize int8."""
    from torchao.quantization import Int8WeightOnlyConfig

    from devmap.compat import torchao_int8_rows

    clone = copy.deepcopy(model)
    linears = [m for layer in clone.model.layers for m in layer.modules() if type(m) is nn.Linear]
    torchao_int8_rows(linears, Int8WeightOnlyConfig(set_inductor_config=False))
    return clone


def test_int8_projections_join_their_data_and_scales_and_decode_torchaos_tokens(model, monkeypatch):
    pytest.importorskip("torchao")
    quantized = int8_copy(model)
    clone = copy.deepcopy(quantized)
    assert join_projections(clone) == 2 * len(model.model.layers)
    attention = clone.model.layers[0].self_attn
    assert len({p.weight.qdata.untyped_storage().data_ptr()
                for p in (attention.q_proj, attention.k_proj, attention.v_proj)}) == 1
    layer = JoinedLayer.of(clone.model.layers[0], "llama")
    assert isinstance(layer.qkv.quantized, Int8Weight) and isinstance(layer.down.quantized, Int8Weight)
    assert layer.qkv.weight is None
    assert len(CausalLMStages(clone).joined) == len(model.model.layers)
    ids = torch.randint(3, 500, (2, 9))
    torch.testing.assert_close(clone(ids).logits, quantized(ids).logits, rtol=0, atol=0)  # torchao's forward
    expected = quantized.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(clone, ids, max_new_tokens=10, split_layers=[2], eos_token_id=[]), expected)


def test_int8_joined_steps_compile_once_for_every_batch_size(model, compiles_once_for_every_batch_size,
                                                            compiled_on_cpu):
    """The int8 product is an operator of its own: a compiled continuous batch (aot_eager: inductor's tracing and
    guards) traces it whole and never guards on its rows, so batches of other sizes compile nothing more, and the
    tokens equal the eager batch's."""
    pytest.importorskip("torchao")
    compiles_once_for_every_batch_size(joined_copy(int8_copy(model)), compiled_on_cpu)


def test_int8_kernel_variants_are_prepared_once_per_weight_shape_and_row_bucket(model, monkeypatch):
    """A service prepares the kernels' variants at load: each distinct int8 weight shape once per prepared row
    count (every block shape and Triton's specializations, and each tile height past DECODE_ROWS), none on the CPU,
    where the kernels do not run."""
    from devmap.kernels import int8_products
    from devmap.generation.joined_projections import joined_products

    pytest.importorskip("torchao")
    clone = joined_copy(int8_copy(model))
    weights = [p.quantized for p in joined_products(clone) if p.quantized is not None]
    assert len(weights) == 4 * len(model.model.layers)  # qkv, o, gate_up, down per layer
    assert int8_products.prepare_kernels(weights, torch.float32) == 0  # CPU: torchao's formula, nothing to prepare
    runs = []
    monkeypatch.setattr(int8_products, "kernel_applies", lambda x, weight: True)
    monkeypatch.setattr(int8_products, "kernel_product",
                        lambda x, q, s: runs.append((x.shape[0], tuple(q.shape))))
    monkeypatch.setattr(int8_products, "tokens_product",
                        lambda x, q, s: runs.append((x.shape[0], tuple(q.shape))))
    shapes = {tuple(q.shape) for q, _ in weights}
    assert int8_products.prepare_kernels(weights, torch.bfloat16) == len(shapes) * len(int8_products.PREPARED_ROWS)
    assert set(runs) == {(rows, shape) for rows in int8_products.PREPARED_ROWS for shape in shapes}
    assert {rows for rows, _ in runs} > {int8_products.DECODE_ROWS, int8_products.DECODE_ROWS + 1,
                                         int8_products.SMALL_TOKEN_ROWS + 1}
    assert joined_products(model) == []  # nothing joined, nothing int8


INT8_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from devmap.kernels import int8_products
    from devmap.kernels.int8_products import BlockShape, kernel_product, tokens_product

    torch.manual_seed(0)
    # every decode block shape: narrow (split in 4 and 8 shares, more than inner blocks), wide (no split)
    for rows, outs, ins in ((1, 96, 200), (5, 64, 128), (20, 64, 260), (32, 40, 300), (3, 8200, 130), (30, 8200, 70)):
        x = torch.randn(rows, ins, dtype=torch.float16)
        weight = torch.randn(outs, ins)
        scale = weight.abs().amax(1, keepdim=True) / 127
        qdata = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        got = kernel_product(x, qdata, scale)
        want = (x.float() @ qdata.float().t()) * scale.t()
        assert got.shape == (rows, outs) and got.dtype == x.dtype
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # past DECODE_ROWS: each row quantized to int8 (rounded half to even, as torch.round), int32 sums; several row and
    # output blocks, an inner dimension the block divides and one it does not, and the default tile
    for rows, outs, ins in ((70, 40, 96), (130, 72, 100), (65, 96, 256)):
        x = torch.randn(rows, ins, dtype=torch.float16)
        x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # scale 1: the halves round to even
        weight = torch.randn(outs, ins)
        scale = weight.abs().amax(1, keepdim=True) / 127
        qdata = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        # max / 127 as torch computes it on a GPU (times 1/127 rounded to float32; on a CPU it divides)
        token_scale = x.float().abs().amax(1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
        want = ((x.float() / token_scale).round() @ qdata.float().t()) * token_scale * scale.t()
        for shape in (BlockShape(32, 32, 1, 4, 2, rows=32), BlockShape(16, 64, 1, 4, 2, rows=16), None):
            got = tokens_product(x, qdata, scale, shape)
            assert got.shape == (rows, outs) and got.dtype == x.dtype
            torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
        one_pass, int8_products.ONE_PASS_ROW = int8_products.ONE_PASS_ROW, 64  # then rows read twice, in blocks
        torch.testing.assert_close(tokens_product(x, qdata, scale).float(), want, atol=1e-2, rtol=1e-2)
        int8_products.ONE_PASS_ROW = one_pass
    print("kernel ok")
""")


def test_int8_kernel_equals_the_plain_product_in_tritons_interpreter(tritons_interpreter):
    done = tritons_interpreter(INT8_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel ok" in done.stdout
