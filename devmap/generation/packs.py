"""Prompts packed end to end through every stage of a continuous batch's lanes: the machinery both ways of joining
share (`join_prefill.JoinApart` prefills packs between two steps, `mixed_joins.Riding` carries them in the decode
steps). A pack of a given width is one captured prefill per stage (`joins`: sixteen widths up to the batch's pack
limit), each writing the same scratch cache of one row per stage, from which the joiners' keys and values are copied
into their rows.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from .joins import pack_limit, packed_context, packed_prompts, to_device
from .lane_cache import LaneCache
from .lane_runner import LaneRunner
from .step_cache import StepCache
from ..pipelining.streams import hand_off


class Packs:
    """A batch's packs: its lanes (`run`), the captured steps kept for its shape (`entries`, `cache`) and its cache
    length."""

    def __init__(self, run: LaneRunner, entries: dict[Any, Any], cache: StepCache, cache_len: int) -> None:
        self.run, self.s = run, run.s
        self.entries, self.cache, self.cache_len = entries, cache, cache_len

    @property
    def limit(self) -> int:
        """The most prompt tokens of one pack of this batch (`joins.pack_limit`)."""
        return pack_limit(self.cache_len, sum(lane.ids.shape[0] for lane in self.run.lanes))

    def inputs(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, dict, Any]:
        """(ids, mask and positions, the event they are ready at) of a pack of `width` tokens, on stage 0's stream."""
        ids, segments, positions = packed_prompts(prompts, width)
        with self.run.on(0) as first:
            device = self.s.stages[0].device
            ids = to_device(ids, self.s.embed_device)
            context = packed_context(to_device(segments, device), to_device(positions, device),
                                     self.s.float_mask_dtype())
            return ids, context, self.run.record(first)

    def through_stages(self, width: int, ids: torch.Tensor, context: dict, ready: Any,
                       after: Callable[[int, torch.device, LaneCache], None] | None = None) -> torch.Tensor:
        """The pack's captured prefill on every stage (`after(j, device, scratch)` once stage j's is issued); the
        last stage's output."""
        run, last = self.run, len(self.s.stages) - 1
        key = ("join", width)
        if key not in self.entries:  # per stage: the captured prefill and the scratch cache it fills
            self.entries[key] = [self._step(j, width, context["attention_mask"])
                                 for j in range(len(self.s.stages))]
        out = event = None
        for j, stage in enumerate(self.s.stages):
            (prefill, positions, static_mask), scratch = self.entries[key][j]
            with run.on(j) as compute:
                # the same captured prefill may run again (the next pack's, the next step's) before this stage
                # has got through this one: its fixed inputs are written on the stage's own stream (after its
                # earlier replays), and its output is copied before it goes on to the next stage
                move = partial(onto, device=stage.device, j=j, streams=run.streams, compute=compute)
                prefill.static_in.copy_(ids if j == 0 else move(out, event))
                positions.copy_(move(context["position_ids"], ready))
                static_mask.copy_(move(context["attention_mask"], ready))
                with run.clock.around(j, compute):
                    out = prefill.handed_on(prefill(), j < last)
                    if after is not None:
                        after(j, stage.device, scratch)
                event = run.record(compute)
        return out

    def forget_steps(self) -> None:
        """Drop every width's prefill steps (their scratch caches stay): each is made anew at its next use."""
        for key in [key for key in self.entries if isinstance(key, tuple) and key[0] == "join"]:
            del self.entries[key]

    def _step(self, j: int, width: int, mask: torch.Tensor) -> tuple[Any, LaneCache]:
        """Stage j's prefill of a pack of this width, into the stage's scratch cache (both kept). Every width
        writes the same scratch of `limit` columns from its first on, as packs run one after another on the
        stage's stream: one buffer per layer whatever the width, so a prefill compiled for every width reads the
        same buffers. They are made on that stream: zeros filled on another stream could land after the stage's
        first write into them."""
        scratch = self.scratch(j)
        with self.run.on(j):
            return self.run.prefill.prefill_step(j, 1, width, mask, self.cache, scratch), scratch

    def scratch(self, j: int) -> LaneCache:
        """Stage j's scratch cache of one row of `limit` columns, where every pack's prompts are prefilled
        (made at first use, kept with the batch's steps)."""
        scratch = self.entries.get(("join-scratch", j))
        if scratch is None:
            with self.run.on(j):  # made on the stage's stream, which writes them next (the sanitizer's finding)
                stage = self.s.stages[j]
                scratch = self.entries[("join-scratch", j)] = LaneCache(1, self.limit, stage.device)
                layout = self.s.kv_layout(j)
                if layout is not None:
                    scratch.allocate(*layout, self.s.dtype)
        return scratch


def onto(x: torch.Tensor, event: Any, device: torch.device, j: int, streams: Any, compute: Any) -> torch.Tensor:
    """`x` (ready once `event` fires) usable on stage j's `compute` stream of `device` (None on a CPU)."""
    return hand_off(x, event, device, j, streams, compute) if compute is not None else x.to(device)
