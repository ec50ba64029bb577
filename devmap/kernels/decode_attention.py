"""Decode attention over a lane's live cache columns only: one query token per row against a KV cache whose columns
are reused around its end (`lane_cache`), where the step's boolean mask says which columns each row attends to.

transformers' sdpa reads every column of the cache on every decode step, the ones no request holds too: a
continuous batch of 32 rows over 512 columns of a 13B model reads 13 GB of keys and values a step, where its live
columns are often a third of that. `live_columns_attention` is a Triton split-KV kernel (flash-decoding): each
program takes one row, one KV head (all its query heads) and one chunk of columns, reads the chunk's mask, and the
keys and values of its live columns only (masked loads); a second kernel merges the chunks' partial results by
their log-sum-exp. The mask is the only thing it needs, so the wrap-around, joins and ended rows need no
bookkeeping of their own.

It runs on CUDA for fp16/bf16 caches with a power-of-two head size; `supports` says when. `decode_step_attention`
is the attention a decode step runs with (`compat.with_decode_attention`): this kernel where it runs, else sdpa with
a KV head's query heads packed as its queries (grouped KV heads: transformers' sdpa would copy the cache to every
query head), else transformers' sdpa. `reference_attention` is the kernel's computation in plain torch, for tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..compat import sdpa_attention

MERGED_CHUNKS = 16  # chunks the merge reads at once: a 1,024-column cache's in one load
CHUNK = 64  # columns per program: a 512-column cache of one row and 40 heads makes 320 programs, each reading its
# keys and values in one go (longer chunks, looping, measured latency-bound at under half the bandwidth)
LEAST_QUERY_BLOCK = 16  # tl.dot's smallest block: a KV head's query heads are padded up to it


UNSUPPORTED_OPTIONS = ("sliding_window", "softcap", "s_aux")  # attention options the kernel does not implement


def decode_step_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: the attention of a decode step (any call that is no decode step, a
    prompt's, goes to transformers' sdpa)."""
    options = any(kwargs.get(name) is not None for name in UNSUPPORTED_OPTIONS)
    if dropout == 0.0 and not options and supports(query, key, attention_mask):
        return live_columns_attention(query, key, value, attention_mask, scaling), None
    rows, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    if length != 1 or groups == 1 or options or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    packed = query.reshape(rows, heads // groups, groups, dim)  # query head h serves KV head h // groups
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


def supports(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `live_columns_attention` takes these: one query token per row on CUDA, fp16/bf16, a head size of
    16..256 that is a power of two, KV heads dividing the query heads, and a boolean mask of rows × 1 × 1 × columns."""
    rows, heads, length, dim = query.shape
    return (query.is_cuda and length == 1 and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == query.dtype and 16 <= dim <= 256 and dim & (dim - 1) == 0
            and heads % key.shape[1] == 0 and mask is not None and mask.dtype == torch.bool
            and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)


def live_columns_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale over the columns `mask` keeps)·v for query (rows × heads × 1 × dim), key and value (rows ×
    KV heads × columns × dim, the last dimension contiguous) and mask (rows × 1 × 1 × columns, booleans, every row
    keeping at least one column); the output as rows × 1 × heads × dim (transformers' attention layout)."""
    from .decode_attention_kernel import merge_chunks, partial_attention

    rows, heads, _, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    group = heads // kv_heads
    chunks = (columns + CHUNK - 1) // CHUNK
    partial = torch.empty((rows, heads, chunks, dim), dtype=torch.float32, device=query.device)
    log_sums = torch.empty((rows, heads, chunks), dtype=torch.float32, device=query.device)
    out = torch.empty((rows, 1, heads, dim), dtype=query.dtype, device=query.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    partial_attention[(rows, kv_heads, chunks)](
        query, key, value, mask, partial, log_sums,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(3),
        columns, scale,
        GROUP=group, BLOCK_GROUP=max(LEAST_QUERY_BLOCK, 1 << (group - 1).bit_length()), DIM=dim, CHUNK=CHUNK)
    merge_chunks[(rows, heads)](partial, log_sums, out, chunks, out.stride(0), out.stride(2), DIM=dim,
                                BLOCK=MERGED_CHUNKS)
    return out


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """What `live_columns_attention` computes, in plain torch (float32), in its output layout."""
    rows, heads, _, dim = query.shape
    group = heads // key.shape[1]
    keys = key.float().repeat_interleave(group, 1)
    values = value.float().repeat_interleave(group, 1)
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    scores = (query.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, -1) @ values
    return out.transpose(1, 2).to(query.dtype)
