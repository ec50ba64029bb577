"""Requests joining a continuous batch between two decode steps: their prompts are prefilled through every stage
in sub-groups of similar lengths (a captured step per bucketed sub-group shape), each one's keys and values copied
into its row's columns right before the lanes' shared cache slot, its row's mask and position offset reset on
every stage, and its first token put in place of the row's input for the next step. Stage j runs sub-group g
while stage j + 1 runs g - 1.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from .joins import arena_tokens, group_context, join_groups, join_shapes, on_device, padded_prompts, to_device
from .lane_cache import LaneCache
from .lane_runner import record_event
from .row_types import SlotRequest
from .sampling import choose
from ..pipelining.streams import hand_off, to_host


class JoinPrefills:
    """The joining half of `ContinuousBatch` (its rows, lanes, captured steps and sampling are the batch's)."""

    def join(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> None:
        """Start each (request, lane, row) before the lanes' step `step`, which writes cache slot `slot`: prefills of
        them in sub-groups of similar lengths (a captured step per bucketed sub-group shape, padded with copies of
        its first prompt), their keys and values copied into their rows, their first tokens into their rows'
        inputs. Stage j runs sub-group g while stage j + 1 runs g - 1."""
        for request, _, _ in joining:
            self.check(request)
        run, lanes, last = self.run, self.run.lanes, len(self.s.stages) - 1
        groups = join_groups([len(r.prompt) for r, _, _ in joining], self.first_slot,
                             sum(lane.ids.shape[0] for lane in lanes))
        chosen = [self._prefill_group([joining[i] for i in indices], rows, width, slot)
                  for indices, rows, width in groups]
        order = [i for indices, _, _ in groups for i in indices]  # joiner at each place of the tokens
        per_lane: dict[int, list[tuple[int, int]]] = {}  # lane: (place in the tokens, row)
        for place, index in enumerate(order):
            _, k, row = joining[index]
            per_lane.setdefault(k, []).append((place, row))
        with run.on(last) as compute:
            tokens = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
            host = to_host(tokens)
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

    def capture_joins(self) -> None:
        """Capture the prefill of every sub-group shape this batch can meet, before its first step (on GPUs): a
        shape's first use otherwise costs an eager run and a capture in the middle of a burst of requests."""
        most = sum(lane.ids.shape[0] for lane in self.run.lanes)
        for group, width in join_shapes(self.first_slot, most):
            if ("join", group, width) not in self.entries:
                inputs = self._group_inputs([[0]] * group, group, width)
                for _ in range(2):  # eager, then captured
                    self._through_stages(group, width, *inputs)

    def _prefill_group(self, members: list[tuple[SlotRequest, int, int]], group: int, width: int,
                       slot: int) -> torch.Tensor:
        """One sub-group's prefill through every stage, its rows' keys and values copied into the lanes' caches;
        returns its first tokens (on the last stage's stream)."""
        lanes = self.run.lanes
        prompts = [r.prompt for r, _, _ in members]
        per_lane: dict[int, list[tuple[int, int, int]]] = {}  # lane: (place in the group, row, prompt length)
        for place, (request, k, row) in enumerate(members):
            per_lane.setdefault(k, []).append((place, row, len(request.prompt)))

        def into_rows(j: int, device: torch.device, scratch: LaneCache) -> None:
            for k, items in per_lane.items():  # the joiners' keys and values into their rows, before the slot
                index = on_device([place for place, _, _ in items], device)
                rows = on_device([row for _, row, _ in items], device)
                lanes[k].caches[j].take_rows(scratch, index, rows, slot - width, slot)
                lanes[k].inputs[j].join(rows, on_device([n for _, _, n in items], device), slot)

        out = self._through_stages(group, width, *self._group_inputs(prompts, group, width), into_rows)
        with self.run.on(len(self.s.stages) - 1):
            return choose(self.s.head(out[:len(members), -1:, :])[:, -1].float(), self.sampling, self.generator)

    def _group_inputs(self, prompts: list[list[int]], group: int, width: int) -> tuple[torch.Tensor, dict, Any]:
        """(ids, mask and positions, the event they are ready at) of a sub-group, on stage 0's stream; the prompts
        left-padded to `width`, the rows past them copies of the first."""
        ids, mask = padded_prompts(prompts + prompts[:1] * (group - len(prompts)), pad=0, width=width)
        with self.run.on(0) as first:
            ids, mask = to_device(ids, self.s.embed_device), to_device(mask, self.s.stages[0].device)
            context = group_context(mask, self.s.float_mask_dtype())
            return ids, context, record_event(first)

    def _through_stages(self, group: int, width: int, ids: torch.Tensor, context: dict, ready: Any,
                        after: Callable[[int, torch.device, LaneCache], None] | None = None) -> torch.Tensor:
        """The sub-group's captured prefill on every stage (`after(j, device, scratch)` once stage j's is issued);
        the last stage's output."""
        run, last = self.run, len(self.s.stages) - 1
        key = ("join", group, width)
        if key not in self.entries:  # per stage: the captured prefill and the scratch cache it fills
            self.entries[key] = [self._join_step(j, group, width, context["attention_mask"])
                                 for j in range(len(self.s.stages))]
        out = event = None
        for j, stage in enumerate(self.s.stages):
            (prefill, positions, static_mask), scratch = self.entries[key][j]
            with run.on(j) as compute:
                # the same captured prefill may run again (the next sub-group's, the next step's) before this stage
                # has got through this one: its fixed inputs are written on the stage's own stream (after its
                # earlier replays), and its output is copied before it goes on to the next stage
                move = partial(_onto, device=stage.device, j=j, streams=run.streams, compute=compute)
                prefill.static_in.copy_(ids if j == 0 else move(out, event))
                positions.copy_(move(context["position_ids"], ready))
                static_mask.copy_(move(context["attention_mask"], ready))
                out = prefill.handed_on(prefill(), j < last)
                if after is not None:
                    after(j, stage.device, scratch)
                event = record_event(compute)
        return out

    def _join_step(self, j: int, group: int, width: int, mask: torch.Tensor) -> tuple[Any, LaneCache]:
        """Stage j's prefill of a joining sub-group of this shape, into a scratch cache of its own (both kept): a
        view into the stage's one arena, as sub-groups run one after another on the stage's stream. Its buffers are
        made on that stream: zeros filled on another stream could land after the stage's first write into them."""
        stage = self.s.stages[j]
        with self.run.on(j):  # made on the stage's stream, which writes them next (the sanitizer's finding)
            scratch = LaneCache(group, width, stage.device)
            layout = self.s.kv_layout(j)
            if layout is not None:
                if ("join-arena", j) not in self.entries:
                    tokens = arena_tokens(sum(lane.ids.shape[0] for lane in self.run.lanes), self.cache_len)
                    size = LaneCache.arena_size(tokens, len(layout[0]), layout[1], layout[2])
                    self.entries[("join-arena", j)] = torch.zeros(size, dtype=self.s.dtype, device=stage.device)
                scratch.allocate(*layout, self.s.dtype, arena=self.entries[("join-arena", j)])
            return self.run.prefill_step(j, group, width, mask, self.cache, scratch), scratch


def _onto(x: torch.Tensor, event: Any, device: torch.device, j: int, streams: Any, compute: Any) -> torch.Tensor:
    """`x` (ready once `event` fires) usable on stage j's `compute` stream of `device` (None on a CPU)."""
    return hand_off(x, event, device, j, streams, compute) if compute is not None else x.to(device)
