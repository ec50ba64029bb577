"""int4 weights in devmap's plain layout: packing, the numbers they stand for, the CPU product, Linear modules of
them joined and decoding as the unjoined model does, and the kernels in Triton's interpreter (on a GPU:
`test_gpu_four_bit_products.py`)."""

import copy
import textwrap

import pytest
import torch
from torch import nn

from devmap import generate
from devmap.kernels.four_bit_linear import FourBitLinear, own_four_bit_linears
from devmap.kernels.four_bit_layout import (
    INT4_CODE_VALUES, FourBitWeight, codes, dequantize, packed_halves, quantize_int4, span_of)
from devmap.kernels.four_bit_products import kernel_applies, product
from devmap.generation.joined_projections import JoinedLayer, every_layer_joined, join_projections, joined_products


def test_codes_pack_two_a_byte_in_group_halves():
    q = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    packed = packed_halves(q, 128)
    assert packed.shape == (3, 128) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0] & 15, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 64])
    assert torch.equal(packed[:, 64] & 15, q[:, 128])  # the second group starts its own halves
    assert torch.equal(codes(packed, 128), q)


def test_groups_smaller_than_the_span_pair_up_in_their_bytes():
    """Groups of 64 (nf4's blocks) and 32 go two a span where the inner dimension holds whole pairs: the first group's
    weights in the bytes' low halves, the second's in the high halves; groups of 128 and more, or an odd count of
    groups, stay one a span. Packing and unpacking by the span give the codes back either way."""
    assert [span_of(256, g) for g in (32, 64, 128, 256)] == [64, 128, 128, 256]
    assert span_of(192, 64) == 64 and span_of(384, 64) == 128 and span_of(96, 32) == 32
    torch.manual_seed(3)
    for ins, group in ((256, 64), (192, 64), (256, 128)):
        weight = quantize_int4(torch.randn(4, ins), group=group)
        span = span_of(ins, group)
        assert weight.span == span and weight.paired == (span == 2 * group)
        q = codes(weight.packed, span)
        assert torch.equal(weight.packed[:, 0] & 15, q[:, 0]) and torch.equal(weight.packed[:, 0] >> 4, q[:, span // 2])
        assert torch.equal(packed_halves(q, span), weight.packed)
        grouped = (dequantize(weight, torch.float32) - weight.zero.repeat_interleave(group, 1)).reshape(4, -1, group)
        assert (grouped.abs().amax(-1) <= 8 * weight.scale.float() + 1e-5).all()  # each group by its own scale


def test_weights_come_back_within_half_a_step_of_their_group():
    torch.manual_seed(0)
    weight = torch.randn(48, 512) * torch.linspace(0.1, 3, 512)
    quantized = quantize_int4(weight)
    assert quantized.scale.shape == quantized.zero.shape == (48, 4) and quantized.group == 128
    error = (dequantize(quantized, torch.float32) - weight).abs().reshape(48, 4, 128).amax(-1)
    assert (error <= quantized.scale / 2 + 1e-5).all()
    q = codes(quantized.packed, 128).reshape(48, 4, 128)
    assert (q.amin(-1) == 0).all() and (q.amax(-1) == 15).all()  # each group's ends are codes 0 and 15
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_int4(torch.randn(4, 200))


def test_the_cpu_product_is_the_dequantized_weights_product():
    torch.manual_seed(2)
    weight = quantize_int4(torch.randn(40, 256))
    x, bias = torch.randn(2, 3, 256), torch.randn(40)
    assert not kernel_applies(x.reshape(-1, 256), weight)
    torch.testing.assert_close(product(x, weight, bias),
                               x @ dequantize(weight, torch.float32).t() + bias)


# bitsandbytes' nf4 table (`bitsandbytes.functional.get_4bit_type("nf4")`)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def int4_layers(model: nn.Module, code_values: tuple[float, ...] | None = None) -> nn.Module:
    """The model with every Linear of its decoder layers a FourBitLinear of its weight (int4's code values, or the 4
    bits standing for `code_values` with int4's scales and no zeros, as nf4's)."""
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear):
                parent, _, attr = name.rpartition(".")
                weight = quantize_int4(module.weight.data, group=32)  # the tiny model's sizes are multiples of 32
                if code_values is not None:
                    weight = weight._replace(code_values=code_values, zero=None)
                setattr(layer.get_submodule(parent), attr, FourBitLinear(weight, None))
    return model


def test_a_table_of_code_values_stands_for_them_in_the_scales_dtype():
    torch.manual_seed(1)
    weight = quantize_int4(torch.randn(8, 128), group=64)._replace(code_values=NF4)
    q = codes(weight.packed, weight.span).reshape(8, 2, 64)
    want = torch.tensor(NF4)[q.long()] * weight.scale.float()[..., None] + weight.zero.float()[..., None]
    halved = weight._replace(scale=weight.scale.to(torch.bfloat16), zero=weight.zero.to(torch.bfloat16))
    rounded = (torch.tensor(NF4).to(torch.bfloat16).float()[q.long()] * halved.scale.float()[..., None]
               + halved.zero.float()[..., None])
    assert torch.equal(dequantize(halved, torch.bfloat16), rounded.reshape(8, 128).to(torch.bfloat16))
    assert not weight.affine and quantize_int4(torch.randn(8, 128)).affine
    torch.testing.assert_close(dequantize(weight, torch.float32), want.reshape(8, 128), rtol=0, atol=0)
    zeroless = (torch.tensor(NF4)[q.long()] * weight.scale.float()[..., None]).reshape(8, 128)
    assert torch.equal(dequantize(weight._replace(zero=None), torch.float32), zeroless)
    x = torch.randn(3, 128)
    torch.testing.assert_close(product(x, weight), x @ want.reshape(8, 128).t())


@pytest.mark.parametrize("table", [None, NF4], ids=["int4", "nf4"])
def test_int4_projections_join_and_decode_the_unjoined_models_tokens(tiny_llama, table):
    torch.manual_seed(0)
    model = int4_layers(tiny_llama(), table)
    reference = copy.deepcopy(model)
    assert own_four_bit_linears(model) == 0  # nothing of torchao's here: nothing to take apart
    assert join_projections(model) == 2 * len(model.model.layers) and every_layer_joined(model)
    attention = model.model.layers[0].self_attn
    assert len({p.packed.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj,
                                                                 attention.v_proj)}) == 1
    layer = JoinedLayer.of(model.model.layers[0], "llama")
    assert isinstance(layer.qkv.quantized, FourBitWeight) and layer.qkv.weight is None
    assert layer.qkv.quantized.code_values == (table or INT4_CODE_VALUES)
    assert (layer.qkv.quantized.zero is None) == (table is not None)  # a table's weights join without zeros
    four_bit = [p for p in joined_products(model) if isinstance(p.quantized, FourBitWeight)]
    assert len(four_bit) == 4 * len(model.model.layers)
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    expected = reference.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, split_layers=[2], eos_token_id=[]), expected)


def test_int4_joined_steps_compile_once_for_every_batch_size(model, compiles_once_for_every_batch_size,
                                                            compiled_on_cpu):
    """The int4 product is an operator of its own: a compiled continuous batch (aot_eager) traces it whole and never
    guards on its rows, so batches of other sizes compile nothing more, and the tokens equal the eager batch's."""
    clone = int4_layers(copy.deepcopy(model))
    assert join_projections(clone) == 2 * len(clone.model.layers)
    compiles_once_for_every_batch_size(clone, compiled_on_cpu)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from devmap.kernels.four_bit_layout import dequantize, quantize_int4
    from devmap.kernels.four_bit_products import BlockShape, block_shape, kernel_product, dequantized
    torch.manual_seed(0)
    # one block of rows (split or not, uneven output blocks), tiles of rows, and the rule's shape
    for rows, outs, ins, shape in ((1, 96, 256, None), (5, 64, 384, BlockShape(64, 2)),
                                   (17, 130, 256, BlockShape(32, 3)), (32, 64, 128, None),
                                   (150, 64, 256, BlockShape(32, 2, rows=64)), (70, 64, 256, None),
                                   (140, 160, 256, None), (3, 64, 384, BlockShape(64, 2)), (40, 96, 256, None)):
        # groups of 128 (a span each), and of 64 in pairs (nf4's) where 256 or 384 inputs come
        weight = quantize_int4(torch.randn(outs, ins), group=128 if rows in (1, 32, 150, 140, 17) else 64)
        x = torch.randn(rows, ins, dtype=torch.float16)
        want = x.float() @ dequantize(weight, torch.float16).float().t()
        torch.testing.assert_close(kernel_product(x, weight, shape).float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dequantized(weight, torch.float16), dequantize(weight, torch.float16))
        table = weight._replace(code_values=tuple(torch.randn(16).tolist()))  # a table of code values (nf4's kind)
        want = x.float() @ dequantize(table, torch.float16).float().t()
        torch.testing.assert_close(kernel_product(x, table, shape).float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dequantized(table, torch.float16), dequantize(table, torch.float16))
        zeroless = table._replace(zero=None)  # no zeros (nf4's): none read
        want = x.float() @ dequantize(zeroless, torch.float16).float().t()
        torch.testing.assert_close(kernel_product(x, zeroless, shape).float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dequantized(zeroless, torch.float16), dequantize(zeroless, torch.float16))
    assert block_shape(1, 15360, 40) == BlockShape(64, 2) and block_shape(16, 5120, 40) == BlockShape(64, 6)
    assert block_shape(17, 15360, 40) == BlockShape(128, 2, 8) and block_shape(32, 5120, 40) == BlockShape(128, 6, 8)
    assert block_shape(64, 27648, 40) == BlockShape(64, 1) and block_shape(96, 5120, 40) == BlockShape(64, 3)
    assert block_shape(160, 5120, 40) == BlockShape(128, 6, 8)
    print("kernel ok")
""")


def test_int4_kernels_equal_the_dequantized_product_in_tritons_interpreter(tritons_interpreter):
    done = tritons_interpreter(KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel ok" in done.stdout


def test_a_service_compiles_an_int4_model_by_default_once_every_layer_is_joined(tiny_llama, monkeypatch):
    from devmap.planning.quantization import parse_quantization
    from devmap.serving.warm_up import compiles

    model = int4_layers(tiny_llama())
    model.hf_device_map = {"": 0}
    joined = copy.deepcopy(model)
    join_projections(joined)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not compiles(model, None, parse_quantization("int4"))  # not joined: no compile unless asked
    model = joined
    assert compiles(model, None, parse_quantization("int4")) and not compiles(model, False, parse_quantization("int4"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_bit_patterns_give_each_weight_exactly(dtype):
    """The rows kernel's PTX on CUDA (`_int4_decode_ptx`), step by step on the CPU: each byte's halves set into the
    mantissa of the dtype's magic give magic + q, adding minus gives q - 8 exactly, and the four bytes of a register
    come out as the values of weights j..j+3 (low halves) and GROUP / 2 + j.. (high halves), in order."""
    pytest.importorskip("triton")
    from devmap.kernels.four_bit_products_kernel import INT4_PATTERNS, _int4_decode_ptx

    magic, one, minus, kind = INT4_PATTERNS[dtype]
    ptx = _int4_decode_ptx(magic, one, minus, kind)
    assert f"mov.b32 magic, {magic:#x};" in ptx and f"fma.rn.{kind} $0, t0, $5, $7;" in ptx

    def halves(register: int) -> list[float]:  # a 32-bit register as two values of dtype, low half first
        pair = torch.tensor([register & 0xFFFF, register >> 16], dtype=torch.int32).to(torch.int16)
        return pair.view(dtype).tolist()

    assert halves(one) == [1.0, 1.0]
    q = torch.arange(16)
    exact = halves(magic & 0xFFFF | (minus & 0xFFFF) << 16)
    assert [halves(magic | int(level) | int(level) << 16)[0] for level in q] == [exact[0] + level for level in
                                                                                  q.tolist()]
    assert [halves(magic | int(level))[0] + exact[1] for level in q] == (q - 8).tolist()
    torch.manual_seed(0)
    for word in torch.randint(0, 1 << 32, (50,)).tolist():
        t0 = (word & 0xFF) | ((word >> 8) & 0xFF) << 16  # prmt 0x4140: bytes 0 and 1 into the halves' low bytes
        t1 = ((word >> 16) & 0xFF) | ((word >> 24) & 0xFF) << 16  # prmt 0x4342: bytes 2 and 3
        low = [v + exact[1] for t in (t0, t1) for v in halves(t & 0x000F000F | magic)]
        high = [v + exact[1] for t in (t0, t1) for v in halves((t >> 4) & 0x000F000F | magic)]
        packed = torch.tensor([(word >> 8 * i) & 0xFF for i in range(4)], dtype=torch.uint8)
        assert low == ((packed & 15).int() - 8).tolist() and high == ((packed >> 4).int() - 8).tolist()


def run_ptx(ptx: str, word: int) -> dict[str, int]:
    """The registers after the integer part of a table's PTX (`mov`, `and`, `shr`, `prmt`, `lop3`: everything before
    its fused multiply-adds) with `word` in $4, each instruction as PTX defines it."""
    regs: dict[str, int] = {"$4": word}

    def value(operand: str) -> int:
        return regs[operand] if operand in regs else int(operand, 0)

    for line in ptx.splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "shr.b32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "prmt.b32":  # bytes of {b, a} picked by the selector's nibbles; bit 3: the byte's sign, replicated
            pool, selector, out = value(args[1]) | value(args[2]) << 32, value(args[3]), 0
            for i in range(4):
                nibble = selector >> 4 * i & 0xF
                byte = pool >> 8 * (nibble & 7) & 0xFF
                out |= (0xFF if byte & 0x80 else 0) << 8 * i if nibble & 8 else byte << 8 * i
            regs[args[0]] = out
        elif op == "lop3.b32":  # bit (a, b, c) of the result: bit a·4 + b·2 + c of the immediate
            a, b, c, lut = (value(x) for x in args[1:])
            regs[args[0]] = sum(((lut >> ((a >> k & 1) << 2 | (b >> k & 1) << 1 | (c >> k & 1))) & 1) << k
                                for k in range(32))
        elif op.startswith("fma"):
            break
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_tables_ptx_gives_each_weight_its_code_value(dtype):
    """The kernels' PTX for a table of code values (`table_ptx`, nf4's), run instruction by instruction on the CPU: the
    four bytes of a register come out as the code values (rounded to dtype) of weights j..j+3 (low halves) and SPAN / 2
    + j.. (high halves), in order, two a register, before the scales and zeros: the low halves' pair ($5-$8), then
    the high halves' ($9-$12), as `OPERANDS` counts them."""
    pytest.importorskip("triton")
    from devmap.kernels.four_bit_products_kernel import INT4_PATTERNS, OPERANDS, table_ptx

    ptx = table_ptx(dtype, NF4)
    kind = INT4_PATTERNS[dtype][3]
    assert f"fma.rn.{kind} $0, t0, $5, $7;" in ptx and f"fma.rn.{kind} $3, u1, $10, $12;" in ptx
    assert OPERANDS.value.count("=r") == 4 and OPERANDS.value.count(",") == 12
    table = torch.tensor(NF4).to(dtype)

    def halves(register: int) -> list[float]:  # a 32-bit register as two values of dtype, low half first
        return torch.tensor([register & 0xFFFF, register >> 16], dtype=torch.int32).to(torch.int16).view(dtype).tolist()

    torch.manual_seed(0)
    for word in torch.randint(0, 1 << 32, (200,)).tolist() + [0, 0xFFFFFFFF, 0x88888888, 0x77777777]:
        regs = run_ptx(ptx, word)
        packed = torch.tensor([(word >> 8 * i) & 0xFF for i in range(4)], dtype=torch.uint8)
        assert halves(regs["t0"]) + halves(regs["t1"]) == table[(packed & 15).long()].tolist()
        assert halves(regs["u0"]) + halves(regs["u1"]) == table[(packed >> 4).long()].tolist()


def test_hoppers_kernel_cuts_every_step_it_runs_into_tiles_that_fit():
    """The Hopper kernel's rule (`wgmma_shape`) for every row count it runs (33-256) and a 13B layer's products: one
    tile holds every row with fewer than 32 past the last (64 at least), cut in a power of two and a smaller one or
    none, output columns of whole warpgroups, a ring that fits the SM's shared memory, shares only where the
    blocks are few, and no share without a group of its own."""
    pytest.importorskip("triton.experimental.gluon")
    from devmap.kernels.card import HOPPER
    from devmap.kernels.four_bit_products_wgmma import stage_bytes, wgmma_shape

    for outs, ins, group in ((15360, 5120, 128), (5120, 5120, 128), (27648, 5120, 64), (5120, 13824, 64)):
        span = span_of(ins, group)
        for rows in range(33, 257):
            shape = wgmma_shape(rows, outs, ins // span, span, table=group == 64)
            head = shape.rows - shape.tail
            assert shape.rows >= rows and (shape.rows - rows < 32 or shape.rows in (64, 256)), (rows, shape)
            assert head & (head - 1) == 0 and shape.tail & (shape.tail - 1) == 0 and shape.tail < head
            ring = shape.stages * stage_bytes(shape.rows, shape.out, span)
            assert shape.out in (64, 128) and ring <= HOPPER.ring_bytes
            blocks = -(-outs // shape.out)
            assert shape.splits == 1 or blocks < HOPPER.spread, (rows, outs, shape)
            assert 1 <= shape.splits <= ins // span


def test_a_service_prepares_every_variant_of_hoppers_kernel_a_step_can_run():
    """`prepare_kernels` runs the product at PREPARED_ROWS: among them, rows that give every variant of Hopper's kernel
    (its tile, parts, output columns and stages: what Triton compiles apart) that a step of 33-256 rows can take, so
    that none compiles in the middle of a service's requests (or of a CUDA graph's capture)."""
    pytest.importorskip("triton.experimental.gluon")
    from devmap.kernels.four_bit_products import DECODE_ROWS, PREPARED_ROWS, TILED_ROWS
    from devmap.kernels.four_bit_products_wgmma import wgmma_shape

    for outs, ins, group in ((15360, 5120, 128), (5120, 13824, 64), (2048, 2048, 64)):
        for table in (False, True):
            def variant(rows: int) -> tuple[int, ...]:
                shape = wgmma_shape(rows, outs, ins // span_of(ins, group), span_of(ins, group), table)
                return shape.rows, shape.tail, shape.out, shape.stages

            reachable = {variant(rows) for rows in range(DECODE_ROWS + 1, TILED_ROWS + 1)}
            assert reachable == {variant(rows) for rows in PREPARED_ROWS if DECODE_ROWS < rows <= TILED_ROWS}
