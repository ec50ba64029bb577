"""The Triton kernels behind `decode_attention.live_columns_attention` (imported only where they run: Triton comes
with torch's CUDA wheels). `partial_attention`: one program per row, KV head (all its query heads) and chunk of
columns; `merge_chunks`: one program per row and query head, over that row's chunks.

Triton compiles a kernel anew for each integer argument that is 1 or a multiple of 16 where it was not before; the
counts that follow the cache's length (its columns, its chunks) are left unspecialized, so that a batch whose cache
reaches a multiple of 1,024 columns (16 chunks) launches the kernels it has instead of compiling one in the middle of
an eager step (a service's first requests run eager steps while its compiled ones are made)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["columns"])  # one compile whatever the cache's length (`merge_chunks` too)
def partial_attention(Query, Key, Value, Mask, Partial, LogSums,
                      query_row, query_head, key_row, key_head, key_column,
                      value_row, value_head, value_column, mask_row, mask_column,
                      columns, scale,
                      GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Partial[row, head, chunk] = softmax-weighted values over the chunk's live columns (normalized within the
    chunk), LogSums[row, head, chunk] = the log of its softmax denominator (-inf when no column is live). Keys and
    values of columns the mask leaves out are not read (masked loads fetch nothing), and a chunk with no live column
    only writes its empty result: a row's live columns are a few runs of a cache whose columns are reused around its
    end, so most chunks of a long cache are dead for most rows, and their programs end at once."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    chunks = tl.num_programs(2)
    in_group = tl.arange(0, BLOCK_GROUP)
    heads = kv_head * GROUP + in_group
    real = in_group < GROUP
    dims = tl.arange(0, DIM)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    live = tl.load(Mask + row * mask_row + cols * mask_column, mask=cols < columns, other=0) != 0
    place = (row * (GROUP * tl.num_programs(1)) + heads) * chunks + chunk
    if tl.max(live.to(tl.int32), 0) > 0:
        query = tl.load(Query + row * query_row + heads[:, None] * query_head + dims[None, :], mask=real[:, None],
                        other=0.0)
        key = tl.load(Key + row * key_row + kv_head * key_head + cols[:, None] * key_column + dims[None, :],
                      mask=live[:, None], other=0.0)
        value = tl.load(Value + row * value_row + kv_head * value_head + cols[:, None] * value_column
                        + dims[None, :], mask=live[:, None], other=0.0)
        scores = (tl.dot(query, tl.trans(key)) * scale).to(tl.float32)  # a compiled caller may pass scale as fp64
        scores = tl.where(live[None, :], scores, float("-inf"))
        best = tl.max(scores, 1)
        weights = tl.exp(scores - best[:, None])
        total = tl.sum(weights, 1)
        out = tl.dot(weights.to(value.dtype), value).to(tl.float32) / total[:, None]
        tl.store(Partial + place[:, None] * DIM + dims[None, :], out, mask=real[:, None])
        tl.store(LogSums + place, best + tl.log(total), mask=real)
    else:  # the merge weighs this chunk by exp(-inf) = 0: zeros, never the buffer's garbage (0 × NaN is NaN)
        tl.store(Partial + place[:, None] * DIM + dims[None, :], tl.zeros([BLOCK_GROUP, DIM], tl.float32),
                 mask=real[:, None])
        tl.store(LogSums + place, tl.full([BLOCK_GROUP], float("-inf"), tl.float32), mask=real)


@triton.jit(do_not_specialize=["chunks"])
def merge_chunks(Partial, LogSums, Out, chunks, out_row, out_head, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Out[row, 0, head] = the chunks' partial outputs weighted by their share of the softmax denominator, read
    BLOCK chunks at a time (independent loads, not one dependent load per chunk)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    dims = tl.arange(0, DIM)
    base = (row * heads + head) * chunks
    best = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([DIM], tl.float32)
    for first in range(0, chunks, BLOCK):
        which = first + tl.arange(0, BLOCK)
        there = which < chunks
        log_sums = tl.load(LogSums + base + which, mask=there, other=float("-inf"))
        parts = tl.load(Partial + (base + which)[:, None] * DIM + dims[None, :], mask=there[:, None], other=0.0)
        new_best = tl.maximum(best, tl.max(log_sums, 0))
        anchor = tl.where(new_best > float("-inf"), new_best, 0.0)
        carried = tl.exp(best - anchor)
        weights = tl.exp(log_sums - anchor)
        acc = acc * carried + tl.sum(weights[:, None] * parts, 0)
        total = total * carried + tl.sum(weights, 0)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + row * out_row + head * out_head + dims, out.to(Out.dtype.element_ty))
