"""Static KV caches for one lane on one stage, and the decode-step inputs computed from them on the device.

Every buffer has a fixed address and shape for the whole generation (prompt + new tokens), so a decode
step reads and writes only fixed memory and can be captured once as a CUDA graph and replayed each token.
The slot a step writes is a device tensor that the step itself advances, wrapping around at the cache's end: keys
are stored with their rotary positions applied and attention does not care about column order, so a continuous
batch reuses the columns of requests that ended, and runs as long as each request fits the cache on its own.
"""

from __future__ import annotations

from typing import Any

import torch


class LaneCache:
    """Keys and values of one lane for the decoder layers of one stage (transformers' `Cache.update` protocol).

    While `prefilling`, `update` stores the prompt's keys at slots 0..L-1 and returns them unchanged (attention
    runs over the prompt with its usual causal mask); afterwards it writes one token at `slot` and returns
    the whole buffer, whose unwritten slots the decode mask hides.
    """

    def __init__(self, rows: int, max_len: int, device: torch.device) -> None:
        self.rows, self.max_len, self.device = rows, max_len, device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.prefilling = True
        self.start = 0  # the column a prompt's first token is written to while prefilling
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the column the next decode step writes
        self.tick = torch.zeros(1, dtype=torch.long, device=device)  # the same, not wrapped (positions count it)
        # the length as a device tensor for the step's wrap-around: a step compiled for every cache length reads
        # no Python int that would specialize it
        self.length = torch.full((1,), max_len, dtype=torch.long, device=device)
        self._layers: dict[int, LayerCache] = {}
        # (layer indices, keys, values) where `allocate` made every layer's buffers as slices of one tensor each
        # (layers × rows × KV heads × columns × head dim): prompts are copied into all layers at once
        self.blocks: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

    def allocate(self, layer_indices: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Every layer's buffers up front (zeros: unwritten slots are masked, and must not hold NaNs), so that a
        compiled prefill only copies into them and its first and later calls trace the same code. They are slices of
        one keys and one values tensor, each layer's contiguous (`take_prompts` writes all layers in one copy)."""
        if all(index in self.keys for index in layer_indices):
            return
        shape = (len(layer_indices), self.rows, kv_heads, self.max_len, head_dim)
        keys = torch.zeros(shape, dtype=dtype, device=self.device)
        values = torch.zeros(shape, dtype=dtype, device=self.device)
        for n, index in enumerate(layer_indices):
            self.keys[index], self.values[index] = keys[n], values[n]
        self.blocks = (list(layer_indices), keys, values)

    def start_decoding(self, prompt_len: int) -> None:
        """After the prompt: the next token goes to slot `prompt_len` (issued on the current stream)."""
        self.prefilling = False
        self.slot.fill_(prompt_len % self.max_len)
        self.tick.fill_(prompt_len)

    def place_at(self, tick: int) -> None:
        """The next decode step writes column `tick` (counted without wrapping; issued on the current stream): a lane
        that sat out steps of its batch catches up with the others' slot."""
        self.slot.fill_(tick % self.max_len)
        self.tick.fill_(tick)

    def advance(self) -> None:
        """The next slot (the end of a decode step; wraps around)."""
        self.slot.add_(1).remainder_(self.length)
        self.tick.add_(1)

    def first_rows(self, rows: int) -> LaneCache:
        """This cache's first `rows` rows as a cache of their own (views of the same buffers, the same slot): a decode
        step over them reads and writes only those rows."""
        view = object.__new__(LaneCache)
        view.rows, view.max_len, view.device = rows, self.max_len, self.device
        view.keys = {layer: keys[:rows] for layer, keys in self.keys.items()}
        view.values = {layer: values[:rows] for layer, values in self.values.items()}
        view.blocks = None
        view.prefilling, view.start = False, self.start
        view.slot, view.tick, view.length = self.slot, self.tick, self.length
        view._layers = {}
        return view

    def layer(self, layer_idx: int) -> LayerCache | LaneCache:
        """Layer `layer_idx`'s part of this cache (the same buffers and state), or this whole cache while that layer
        has no buffers yet (a prefill allocates them)."""
        part = self._layers.get(layer_idx)
        if part is None:
            if layer_idx not in self.keys:
                return self
            part = self._layers[layer_idx] = LayerCache(self, self.keys[layer_idx], self.values[layer_idx])
        return part

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's keys and values (rows × KV heads × columns × head dim)."""
        return [*self.keys.values(), *self.values.values()]

    def take_prompts(self, other: LaneCache, begin: int, end: int, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Columns begin..end-1 of `other`'s one row (prompts packed end to end) into this cache: token t of them
        into row `rows[t]`, column `columns[t]` (index tensors on this cache's device). One write for keys and one for
        values where both caches hold their layers in blocks (a write per layer is a few dozen microseconds of the
        host's time: 80 per joining step of a 13B model), else one per buffer."""
        if self.blocks is not None and other.blocks is not None and self.blocks[0] == other.blocks[0]:
            for source, target in zip(other.blocks[1:], self.blocks[1:]):
                # target as (rows, columns, layers, heads, dim); the source's tokens as (tokens, layers, heads, dim)
                target.permute(1, 3, 0, 2, 4).index_put_(
                    (rows, columns), source[:, 0, :, begin:end].permute(2, 0, 1, 3))
            return
        for layer, keys in other.keys.items():
            for source, target in ((keys, self.keys[layer]), (other.values[layer], self.values[layer])):
                target.transpose(1, 2).index_put_((rows, columns), source[0, :, begin:end].transpose(0, 1))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.keys:  # a prefill of a cache allocated lazily
            shape = (key.shape[0], key.shape[1], self.max_len, key.shape[3])
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape)
        return self.layer(layer_idx).update(key, value)


class LayerCache:
    """One decoder layer's keys and values in a `LaneCache` (its buffers, slot and state), with transformers'
    `Cache.update` protocol minus the layer index: a layer compiled once (`devmap.generation.compiled`) reads every
    layer's buffers through its own LayerCache, where an index would make the compiler specialize on each layer's."""

    def __init__(self, lane: LaneCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.lane, self.keys, self.values = lane, keys, values

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """While the lane prefills: the prompt's keys and values into columns start.., returned unchanged (attention
        runs over the prompt alone). Afterwards: one token's into column `slot`, and the whole buffers back."""
        lane = self.lane
        if lane.prefilling:
            start, end = lane.start, lane.start + key.shape[2]
            self.keys[:, :, start:end].copy_(key)
            self.values[:, :, start:end].copy_(value)
            return key, value
        self.keys.index_copy_(2, lane.slot, key)
        self.values.index_copy_(2, lane.slot, value)
        return self.keys, self.values


class DecodeInputs:
    """What a decode step needs besides the hidden state, derived on the device from the lane's slot.

    `prompt_mask` (rows × prompt length, 1 for attended tokens) fixes each row's left padding; a token written
    at slot s sits at position (attended prompt tokens) + (s - prompt length), as transformers counts them:
    each row keeps that offset, so the captured step does not depend on the prompt's length.
    """

    def __init__(self, cache: LaneCache, prompt_mask: torch.Tensor, float_mask_dtype: torch.dtype | None) -> None:
        device = cache.device
        self.cache = cache
        self.attended = torch.ones(prompt_mask.shape[0], cache.max_len, dtype=torch.bool, device=device)
        # rows × 1: whether a row serves a request; a row nobody holds attends to the column its step writes only,
        # so that it reads no keys and values (a continuous batch's free rows would otherwise collect every column)
        self.live = torch.ones(prompt_mask.shape[0], 1, dtype=torch.bool, device=device)
        self.offset = torch.zeros(prompt_mask.shape[0], 1, dtype=torch.long, device=device)
        self.columns = torch.arange(cache.max_len, device=device)
        self.float_mask_dtype = float_mask_dtype  # eager attention adds its mask; sdpa takes booleans
        self.reset(prompt_mask)

    def reset(self, prompt_mask: torch.Tensor, start: int = 0) -> None:
        """A new prompt (any length up to the cache's), written from column `start` on: its padding, and the cache
        back to prefilling."""
        mask = prompt_mask.to(self.cache.device)
        end = start + mask.shape[1]
        self.attended[:, :start].fill_(False)
        self.attended[:, start:end].copy_(mask.bool())
        self.attended[:, end:].fill_(False)  # each decode step marks the column it writes
        self.live.fill_(True)
        self.offset.copy_(mask.long().sum(-1, keepdim=True) - end)
        self.cache.prefilling = True
        self.cache.start = start

    def join(self, rows: torch.Tensor, lengths: torch.Tensor, slot: int) -> None:
        """Rows `rows` now hold prompts of `lengths` tokens written just before slot `slot` (continuous batching;
        counted without wrapping): each attends to its prompt's columns and the ones it writes from `slot` on, its
        next token at position `length`. `rows` and `lengths` are on the cache's device."""
        back = (slot - self.columns) % self.cache.max_len  # how many slots before `slot` each column is
        self.attended.index_copy_(0, rows, (back[None, :] >= 1) & (back[None, :] <= lengths[:, None]))
        self.offset.index_copy_(0, rows, (lengths - slot)[:, None])
        self.live.index_fill_(0, rows, True)

    def vacate(self, row: int | None = None) -> None:
        """Row `row` (None: every row) serves no request from the next step on: it attends to the column its step
        writes only."""
        (self.live if row is None else self.live[row]).fill_(False)

    def first_rows(self, rows: int) -> DecodeInputs:
        """The inputs of a decode step over the first `rows` rows only (views: the same mask, offsets and cache)."""
        view = object.__new__(DecodeInputs)
        view.cache = self.cache.first_rows(rows)
        view.attended, view.offset, view.live = self.attended[:rows], self.offset[:rows], self.live[:rows]
        view.columns, view.float_mask_dtype = self.columns, self.float_mask_dtype
        return view

    def mask(self) -> torch.Tensor:
        """The step's attention mask: the columns each row attends to, the one this step writes included (marked
        here, inside the step); a vacant row's, that column only."""
        self.attended.logical_and_(self.live)
        self.attended.index_fill_(1, self.cache.slot, True)
        keep = self.attended[:, None, None, :]
        if self.float_mask_dtype is None:
            return keep
        zero = torch.zeros((), dtype=self.float_mask_dtype, device=keep.device)
        return torch.where(keep, zero, torch.finfo(self.float_mask_dtype).min)

    def position_ids(self) -> torch.Tensor:
        return self.offset + self.cache.tick
