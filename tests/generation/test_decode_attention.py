"""Decode attention over live cache columns: the Triton kernel (in Triton's interpreter on CPU) against the plain
computation, and the attention a decode step runs with against transformers' sdpa."""

import textwrap

import pytest
import torch

from devmap.kernels import decode_attention
from devmap.kernels.decode_attention import decode_step_attention, reference_attention

KERNEL_CHECK = textwrap.dedent("""
    import torch
    from devmap.kernels.decode_attention import live_columns_attention, reference_attention

    torch.manual_seed(0)
    # (rows, heads, KV heads, columns, head size): grouped and plain heads; columns over several chunks, one not whole,
    # and over more chunks than the merge reads at once
    for rows, heads, kv_heads, columns, dim in [(4, 8, 2, 600, 64), (3, 4, 4, 300, 32), (2, 2, 1, 40, 16),
                                                (3, 4, 2, 1100, 32)]:
        query = torch.randn(rows, heads, 1, dim, dtype=torch.float16)
        key = torch.randn(rows + 1, kv_heads, columns, dim, dtype=torch.float16)[:rows]  # a batch's first rows
        value = torch.randn(rows + 1, kv_heads, columns, dim, dtype=torch.float16)[:rows]
        attended = torch.zeros(rows, columns, dtype=torch.bool)
        attended[0, 5:70] = True  # a live span
        attended[0, columns - 3:] = True  # ... wrapping around the cache's end
        attended[1, :1] = True  # one column
        attended[-1, columns - 1] = True
        if rows > 3:
            attended[2] = torch.rand(columns) > 0.5  # scattered (left padding of a batch that started together)
        mask = attended[:, None, None, :]
        got = live_columns_attention(query, key, value, mask, 0.3)
        expected = reference_attention(query, key, value, mask, 0.3)
        assert got.shape == (rows, 1, heads, dim), got.shape
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    print("kernel ok")
""")


def test_kernel_attends_to_the_live_columns_only_in_tritons_interpreter(tritons_interpreter):
    done = tritons_interpreter(KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel ok" in done.stdout


def _module(groups: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    return module


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_decode_step_attention_on_cpu_attends_like_transformers_sdpa(kv_heads):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = _module(8 // kv_heads)
    query, key, value = torch.randn(3, 8, 1, 16), torch.randn(3, kv_heads, 40, 16), torch.randn(3, kv_heads, 40, 16)
    mask = torch.rand(3, 1, 1, 40) > 0.3
    mask[:, :, :, 0] = True
    got, _ = decode_step_attention(module, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == expected.shape == (3, 1, 8, 16)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, reference_attention(query, key, value, mask, 0.25))
    prompt = torch.randn(3, 8, 5, 16)  # several query tokens: transformers' own sdpa
    causal = torch.ones(3, 1, 5, 40, dtype=torch.bool)
    torch.testing.assert_close(decode_step_attention(module, prompt, key, value, causal)[0],
                               sdpa_attention_forward(module, prompt, key, value, causal)[0])


def test_the_kernel_takes_only_what_it_implements():
    query, key = torch.empty(2, 8, 1, 64, dtype=torch.bfloat16), torch.empty(2, 2, 32, 64, dtype=torch.bfloat16)
    mask = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    assert not decode_attention.supports(query, key, mask)  # on the CPU
    if torch.cuda.is_available():
        query, key, mask = query.cuda(), key.cuda(), mask.cuda()
        assert decode_attention.supports(query, key, mask)
        assert not decode_attention.supports(query.float(), key.float(), mask)
        assert not decode_attention.supports(query, key, mask.float())
        assert not decode_attention.supports(query[:, :, :0].expand(2, 8, 3, 64), key, mask)  # a prompt
        assert not decode_attention.supports(query[..., :48], key[..., :48], mask)  # head size 48
