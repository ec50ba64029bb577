"""Requests joining a continuous batch between two decode steps: their prompts are prefilled through every stage
packed end to end (`joins`: a captured step per pack width), each prompt's keys and values copied into its row's
columns right before the lanes' shared cache slot, its row's mask and position offset reset on every stage, and
its first token put in place of the row's input for the next step. Stage j runs pack g while stage j + 1 runs
g - 1.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from .joins import (on_device, pack_limit, pack_width, pack_widths, packed_context, packed_prompts, packs,
                    prompt_columns, to_device)
from .lane_cache import LaneCache
from .lane_runner import record_event
from .row_types import SlotRequest
from ..pipelining.streams import hand_off, to_host


class JoinPrefills:
    """The joining half of `ContinuousBatch` (its rows, lanes, captured steps and sampling are the batch's)."""

    def join(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> None:
        """Start each (request, lane, row) before the lanes' step `step`, which writes cache slot `slot`: prefills of
        their prompts in packs (a captured step per pack width), their keys and values copied into their rows, their
        first tokens into their rows' inputs. Stage j runs pack g while stage j + 1 runs g - 1."""
        for request, _, _ in joining:
            self.check(request)
        run, lanes, last = self.run, self.run.lanes, len(self.s.stages) - 1
        groups = [sorted(members, key=lambda i: joining[i][1])  # each lane's prompts side by side in a pack
                  for members in packs([len(r.prompt) for r, _, _ in joining], self.pack_limit)]
        chosen, payloads = zip(*(self._prefill_pack([joining[i] for i in members], slot) for members in groups))
        order = [i for members in groups for i in members]  # joiner at each place of the tokens
        per_lane: dict[int, list[tuple[int, int]]] = {}  # lane: (place in the tokens, row)
        for place, index in enumerate(order):
            _, k, row = joining[index]
            per_lane.setdefault(k, []).append((place, row))
        with run.on(last) as compute:
            tokens = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
            host = to_host(torch.cat(payloads) if len(payloads) > 1 else payloads[0])
            event = record_event(compute)
        for k, items in per_lane.items():
            self.pending[k].append((step, event, host, [(row, joining[order[place]][0], place)
                                                        for place, row in items]))
        with run.on(0) as first:  # after each lane's last tokens reached stage 0, its joined rows' are replaced
            device = self.s.stages[0].device
            moved = hand_off(tokens, event, device, 0, run.streams, first) if first is not None else tokens.to(device)
            for k, items in per_lane.items():
                if first is not None and lanes[k].token_ready is not None:
                    first.wait_event(lanes[k].token_ready)
                index = on_device([place for place, _ in items], device)
                rows = on_device([row for _, row in items], device)
                lanes[k].steps[0].static_in.view(-1).index_copy_(0, rows, moved.index_select(0, index))
        for request, k, row in joining:
            self.rows[k][row].issued_to, self.rows[k][row].to_issue = request.owner, request.max_new_tokens
            self.count_issued(k, [row])  # the first token

    @property
    def pack_limit(self) -> int:
        """The most prompt tokens of one pack of this batch (`joins.pack_limit`)."""
        return pack_limit(self.cache_len, sum(lane.ids.shape[0] for lane in self.run.lanes))

    def capture_joins(self) -> None:
        """Capture the prefill of every pack width this batch can meet, before its first step (on GPUs): a width's
        first use otherwise costs an eager run and a capture in the middle of a burst of requests."""
        for width in pack_widths(self.pack_limit):
            if ("join", width) not in self.entries:
                inputs = self._pack_inputs([[0]], width)
                for _ in range(2):  # eager, then captured
                    self._through_stages(width, *inputs)

    def _prefill_pack(self, members: list[tuple[SlotRequest, int, int]],
                      slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One pack's prefill through every stage, each prompt's keys and values copied into its row's columns
        before `slot`; returns the prompts' first tokens and what goes to the host for them (`pick`), on the last
        stage's stream."""
        lanes = self.run.lanes
        prompts = [r.prompt for r, _, _ in members]
        per_lane: dict[int, list[tuple[int, int]]] = {}  # lane: (row, prompt length), side by side in the pack
        for request, k, row in members:
            per_lane.setdefault(k, []).append((row, len(request.prompt)))
        # lane: its tokens' span in the pack, its joined rows and their lengths, and each token's row and cache column
        # (host tensors, computed once for every stage)
        spans, begin = {}, 0
        for k, items in per_lane.items():
            rows, lengths = torch.tensor([row for row, _ in items]), torch.tensor([n for _, n in items])
            end = begin + int(lengths.sum())
            spans[k] = (begin, end, rows, lengths, rows.repeat_interleave(lengths),
                        prompt_columns(lengths, slot, self.cache_len))
            begin = end
        ends = (torch.tensor([len(p) for p in prompts]).cumsum(0) - 1).tolist()  # each prompt's last token

        def into_rows(j: int, device: torch.device, scratch: LaneCache) -> None:
            for k, (first, end, rows, lengths, token_rows, columns) in spans.items():
                lanes[k].caches[j].take_prompts(scratch, first, end, to_device(token_rows, device),
                                                to_device(columns, device))
                lanes[k].inputs[j].join(to_device(rows, device), to_device(lengths, device), slot)

        width = pack_width(begin, self.pack_limit)
        out = self._through_stages(width, *self._pack_inputs(prompts, width), into_rows)
        with self.run.on(len(self.s.stages) - 1):
            last = out[0].index_select(0, on_device(ends, out.device))[:, None, :]  # each prompt's last token
            return self.pick(self.s.head(last)[:, -1].float())

    def _pack_inputs(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, dict, Any]:
        """(ids, mask and positions, the event they are ready at) of a pack of `width` tokens, on stage 0's stream."""
        ids, segments, positions = packed_prompts(prompts, width)
        with self.run.on(0) as first:
            device = self.s.stages[0].device
            ids = to_device(ids, self.s.embed_device)
            context = packed_context(to_device(segments, device), to_device(positions, device),
                                     self.s.float_mask_dtype())
            return ids, context, record_event(first)

    def _through_stages(self, width: int, ids: torch.Tensor, context: dict, ready: Any,
                        after: Callable[[int, torch.device, LaneCache], None] | None = None) -> torch.Tensor:
        """The pack's captured prefill on every stage (`after(j, device, scratch)` once stage j's is issued); the
        last stage's output."""
        run, last = self.run, len(self.s.stages) - 1
        key = ("join", width)
        if key not in self.entries:  # per stage: the captured prefill and the scratch cache it fills
            self.entries[key] = [self._join_step(j, width, context["attention_mask"])
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
                out = prefill.handed_on(prefill(), j < last)
                if after is not None:
                    after(j, stage.device, scratch)
                event = record_event(compute)
        return out

    def _join_step(self, j: int, width: int, mask: torch.Tensor) -> tuple[Any, LaneCache]:
        """Stage j's prefill of a pack of this width, into the stage's scratch cache (both kept). Every width
        writes the same scratch of `pack_limit` columns from its first on, as packs run one after another on the
        stage's stream: one buffer per layer whatever the width, so a prefill compiled for every width reads the
        same buffers. They are made on that stream: zeros filled on another stream could land after the stage's
        first write into them."""
        scratch = self.scratch(j)
        with self.run.on(j):
            return self.run.prefill_step(j, 1, width, mask, self.cache, scratch), scratch

    def scratch(self, j: int) -> LaneCache:
        """Stage j's scratch cache of one row of `pack_limit` columns, where every pack's prompts are prefilled
        (made at first use, kept with the batch's steps)."""
        scratch = self.entries.get(("join-scratch", j))
        if scratch is None:
            with self.run.on(j):  # made on the stage's stream, which writes them next (the sanitizer's finding)
                stage = self.s.stages[j]
                scratch = self.entries[("join-scratch", j)] = LaneCache(1, self.pack_limit, stage.device)
                layout = self.s.kv_layout(j)
                if layout is not None:
                    scratch.allocate(*layout, self.s.dtype)
        return scratch


def onto(x: torch.Tensor, event: Any, device: torch.device, j: int, streams: Any, compute: Any) -> torch.Tensor:
    """`x` (ready once `event` fires) usable on stage j's `compute` stream of `device` (None on a CPU)."""
    return hand_off(x, event, device, j, streams, compute) if compute is not None else x.to(device)
