"""Continuous batching over devmap's lanes: a fixed set of rows decodes step after step, and a new request takes a
free row between two steps instead of waiting for the whole batch to end.

`continuous_batch` opens a batch on a model and hands it to its caller, who drives it step by step (the serving
engine does); `generate_continuous` drives one with two callbacks. A batch starts with empty rows; every request,
the first ones too, joins through a prefill of its own (`continuous_rows`). Decode steps stay the same replayed
graphs (one capture per rows × cache length) and the host never waits for a GPU beyond the token hand-back's lag.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .api import check_length
from .causal_lm import CausalLMStages
from ..errors import UsageError
from ..planning.runtime_memory import layer_kv_bytes
from .continuous_rows import ContinuousBatch
from .joins import JoinShape
from .row_types import Row, SlotRequest, StepFailed
from .lane_runner import LaneRunner, place_lanes, split_lanes
from .mixed_joins import rides_by_default
from .sampling import Sampling
from .step_cache import StepCache, step_cache, weight_pointers

__all__ = ["Admit", "ContinuousBatch", "Emit", "Row", "SlotRequest", "continuous_batch", "generate_continuous"]

KEPT_SHAPES = 2  # (rows, cache length) shapes whose captured steps and KV caches stay on the model


Admit = Callable[[int, int, int], "list[SlotRequest] | None"]
"""(free rows, the longest prompt that fits now, the most new tokens that fit now) -> the requests that start now
(at most the free rows, each fitting), or None to end the run here (its unfinished owners are returned)."""
Emit = Callable[[Any, int], bool]
"""(owner, token) -> True when the owner needs no more tokens (it ended, or went away): its row becomes free."""


@contextlib.contextmanager
@torch.no_grad()
def continuous_batch(model: nn.Module, *, rows: int, first_slot: int, cache_len: int, lanes: int | None = None,
                     sampling: Sampling | None = None, split_layers: list[int] | None = None, graphs: bool = True,
                     compile: bool = False, keep_graphs: bool = True, kv_room: int | None = None,
                     riding: bool | None = None, scores: int | None = None,
                     every_shape: bool = False, join_shapes: Sequence[JoinShape] = ()) -> Iterator["ContinuousBatch"]:
    """A continuous batch of `rows` rows on `model`, driven step by step by its caller:
    `batch.step(joining)` starts requests in free rows and issues one decode step, `batch.collect()` hands back
    the tokens that have come back since (a couple of steps behind the GPUs), `batch.release(owner)` frees the
    rows of an owner that needs no more tokens, `batch.collect(everything=True)` waits for all issued ones.

    Each row's cache holds `cache_len` tokens, its columns reused around the cache's end (keys carry their positions,
    attention ignores column order). The lanes decode from slot `first_slot`; a request needs a prompt of at most
    `batch.longest_prompt` (= first_slot) tokens and at most `batch.most_new_tokens` (= cache_len - first_slot + 1)
    new ones, whenever it joins, so a batch runs as long as requests come. Greedy tokens equal `devmap.generate`
    of each request alone.

    The captured steps and KV caches of the last KEPT_SHAPES (rows, cache length) shapes stay on the model for the
    next batch of that shape; `kv_room` (bytes, all devices together) bounds their KV caches: older shapes are
    dropped before a new one would take more (a serving memory plan makes room for one largest batch).

    `riding`: whether joiners' prompts ride the decode steps (`mixed_joins`, where every decoder layer is joined)
    rather than prefilling between two steps; None: where the model is large enough for it to pay and not 4-bit
    (`mixed_joins.rides_by_default`).

    `scores`: every token comes back with its log-probability and those of the `scores` most likely tokens
    (`generation.scores`; `batch.collect(scored=True)`); None: tokens alone.

    `every_shape`: whether the steps of every join shape run before the first step (with graphs: captured there, as
    a service's warm-up does for the batch it keeps; without: compiling them). By default each shape runs when a
    step first needs it and captures at its second use: a batch's first wave of prompts then pays for the shapes it
    meets, not for every row count and pack width (13B, one H100, 32 clients: TTFT p99 of the first window after a
    restart, docs/serving.md). `join_shapes`: run those join shapes' steps before the first step instead (captured
    there on GPUs): the ones an earlier batch of this shape met (`ContinuousBatch.join_shapes`), which a service
    remembers from one start to the next."""
    sampling = sampling or Sampling()
    sampling.check()
    if rows < 1 or not 0 < first_slot <= cache_len:
        raise UsageError(f"a continuous batch needs rows >= 1 and 0 < first_slot <= cache_len, got rows={rows}, "
                         f"first_slot={first_slot}, cache_len={cache_len}")
    stages = CausalLMStages(model, split_layers)
    check_length(model.config, cache_len)
    stages.check_window(cache_len)
    stages.float_mask_dtype()
    # the lanes start empty: each row is vacant (it attends to the column its step writes only, so that rows nobody
    # holds decode finite garbage); every request, the first ones too, comes in through a joining pack's prefill
    ids = torch.zeros((rows, 1), dtype=torch.long)
    lane_list = split_lanes(stages, ids, torch.ones_like(ids), lanes, default=len(stages.stages))
    place_lanes(stages, lane_list)
    # compile=True compiles the decode step and the joins' prefill, each with dynamic sizes: one compile for every
    # batch shape a service goes through, and one for every pack width (eager, a pack's norms, rotary embeddings,
    # activations and copies are ~40% of its GPU time)
    run = LaneRunner(stages, lane_list, graphs, compile, dynamic=True)
    cache = step_cache(model, "continuous", KEPT_SHAPES) if run.graphs and keep_graphs else StepCache()
    kv_bytes = model.config.num_hidden_layers * layer_kv_bytes(model.config, stages.dtype, rows, cache_len)
    entries = cache.use((run.layout(), tuple(lane.ids.shape[0] for lane in lane_list), cache_len),
                        weight_pointers(model), kv_bytes, kv_room)
    mixing = stages.mixes() and (rides_by_default(model) if riding is None else riding)
    batch = ContinuousBatch(run, first_slot, cache_len, sampling, cache, entries, mixing, scores)

    def vacant() -> None:
        for lane in lane_list:
            for j, inputs in enumerate(lane.inputs):
                inputs.reset(lane.mask, first_slot - 1)
                inputs.vacate()
                lane.caches[j].start_decoding(first_slot)

    with stages.hooks_bypassed():
        for k, lane in enumerate(lane_list):
            run.decode.prepare_decode(k, lane, cache_len, entries, cache)
        vacant()
        if every_shape or join_shapes:
            # join shapes captured (or compiled) up front (steps carrying packs run on the vacant rows: so again)
            run.start()
            batch.joins.capture(None if every_shape else join_shapes)
            run.streams.join([])
            vacant()
        run.start()
        try:
            yield batch
        finally:
            run.streams.join([])


def generate_continuous(model: nn.Module, first: list[SlotRequest], admit: Admit, emit: Emit, *, rows: int,
                        first_slot: int, cache_len: int, lanes: int | None = None, sampling: Sampling | None = None,
                        split_layers: list[int] | None = None, graphs: bool = True, compile: bool = False,
                        keep_graphs: bool = True, stats: dict[str, float] | None = None,
                        riding: bool | None = None, every_shape: bool = False,
                        join_shapes: Sequence[JoinShape] = ()) -> list[Any]:
    """`continuous_batch` run by two callbacks: generate for `first`, and for every request `admit` hands in while
    the batch runs (before each step); every token goes to `emit` in order.

    Ends when every row is free and `admit` brings none, or when `admit` returns None; returns the owners that had
    not finished then (to continue elsewhere, from their prompt plus the tokens they got). `stats`, when given,
    gets the run's steps, joined requests and the host seconds spent issuing them; `riding`, `every_shape` and
    `join_shapes` as `continuous_batch`'s."""
    if not first or len(first) > rows:
        raise UsageError(f"a continuous batch starts with 1 to rows={rows} requests, got {len(first)}")
    with continuous_batch(model, rows=rows, first_slot=first_slot, cache_len=cache_len, lanes=lanes,
                          sampling=sampling, split_layers=split_layers, graphs=graphs, compile=compile,
                          keep_graphs=keep_graphs, riding=riding, every_shape=every_shape,
                          join_shapes=join_shapes) as batch:
        for request in first:
            batch.check(request)
        # owners that said they need no more tokens, by id(); kept alive here, so that no later owner can take the
        # id of one that was freed (its tokens would be dropped as a finished owner's)
        done: dict[int, Any] = {}

        def hand_back(tokens: list[tuple[Any, int]]) -> None:
            for owner, token in tokens:
                if id(owner) not in done and emit(owner, token):
                    done[id(owner)] = owner
                    batch.release(owner)

        joining: list[SlotRequest] | None = first
        while True:
            try:
                if not batch.step(joining):
                    break
            except StepFailed as failed:  # a caller of this function gets the error itself
                raise failed.cause from None
            hand_back(batch.collect())
            joining = admit(batch.free_count(), batch.longest_prompt, batch.most_new_tokens)
            if joining is None:
                break
        hand_back(batch.collect(everything=True))
        unfinished = batch.unfinished()
    if stats is not None:
        stats.update(batch.stats)
    return [owner for owner in unfinished if id(owner) not in done]
