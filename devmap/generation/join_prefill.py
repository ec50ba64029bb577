"""Requests joining a continuous batch between two decode steps: their prompts are prefilled through every stage
packed end to end (`joins`: a captured step per pack width), each prompt's keys and values copied into its row's
columns right before the lanes' shared cache slot, its row's mask and position offset reset on every stage, and
its first token put in place of the row's input for the next step (on stage 0's receive stream, so that no stage's
compute waits for the prefill's last stage but the joiners' lane's next step). Stage j runs pack g while stage j + 1
runs g - 1.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Sequence

import torch

from .joins import JoinShape, on_device, pack_width, pack_widths, packs, prompt_columns, repeated, to_device
from .lane_cache import LaneCache
from .packs import Packs
from .row_types import SlotRequest
from ..pipelining.streams import scatter_later, to_host


class JoinApart:
    """How a `ContinuousBatch` whose steps carry no prompts takes joiners: prefills of their own between two steps
    (`batch`: its rows, lanes and sampling; `packs`: its packed prefills)."""

    def __init__(self, batch: Any, packs: Packs) -> None:
        self.batch, self.packs = batch, packs

    def take(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> dict:
        """Start the joiners now (`join`); none of them rides the step: {}."""
        if joining:
            self.join(joining, step, slot)
        return {}

    def waiting(self) -> list[Any]:
        """Owners holding a row whose prompt has not run: none (a joiner's prompt runs as it joins)."""
        return []

    def drop(self, owner: Any) -> None:
        """`owner` needs no more tokens: nothing of it waits here."""

    def join(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> None:
        """Start each (request, lane, row) before the lanes' step `step`, which writes cache slot `slot`: prefills of
        their prompts in packs (a captured step per pack width), their keys and values copied into their rows, their
        first tokens into their rows' inputs. Stage j runs pack g while stage j + 1 runs g - 1."""
        batch = self.batch
        for request, _, _ in joining:
            batch.check(request)
        run, lanes, last = batch.run, batch.run.lanes, len(batch.s.stages) - 1
        groups = [sorted(members, key=lambda i: joining[i][1])  # each lane's prompts side by side in a pack
                  for members in packs([len(r.prompt) for r, _, _ in joining], self.packs.limit)]
        chosen, payloads = zip(*(self._prefill_pack([joining[i] for i in members], slot) for members in groups))
        order = [i for members in groups for i in members]  # joiner at each place of the tokens
        per_lane: dict[int, list[tuple[int, int]]] = {}  # lane: (place in the tokens, row)
        for place, index in enumerate(order):
            _, k, row = joining[index]
            per_lane.setdefault(k, []).append((place, row))
        with run.on(last) as compute:
            tokens = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
            host = to_host(torch.cat(payloads) if len(payloads) > 1 else payloads[0])
            firsts = {k: tokens.index_select(0, on_device([place for place, _ in items], tokens.device))
                      for k, items in per_lane.items()}
            event = run.record(compute)
        for k, items in per_lane.items():
            batch.pending[k].append((step, event, host, [(row, joining[order[place]][0], place)
                                                         for place, row in items]))
            # after the lane's last tokens reached stage 0, its joined rows' replace them, on stage 0's receive stream:
            # its compute stream goes on with the other lanes' work meanwhile
            lanes[k].token_ready = scatter_later(lanes[k].steps[0].static_in.view(-1), [row for _, row in items],
                                                 firsts[k], event, 0, run.streams, after=lanes[k].token_ready)
        for request, k, row in joining:
            batch.rows[k][row].issued_to, batch.rows[k][row].to_issue = request.owner, request.max_new_tokens
            batch.count_issued(k, [row])  # the first token

    def shapes(self) -> list[JoinShape]:
        """The join shapes this batch made prefills for so far: (0, pack width) each (a prefill apart computes no
        rows; prefills kept for the batch's shape count too)."""
        return sorted((0, key[1]) for key in self.packs.entries if isinstance(key, tuple) and key[0] == "join")

    def capture(self, shapes: Sequence[JoinShape] | None = None) -> None:
        """Capture the prefill of every pack width this batch can meet, before its first step (on GPUs): a width's
        first use otherwise costs an eager run and a capture in the middle of a burst of requests. `shapes`: only
        those widths among them (the shapes an earlier batch met, `shapes()`). Each runs `runs_before_serving`
        times."""
        wanted = None if shapes is None else {width for _, width in shapes}
        for width in pack_widths(self.packs.limit):
            if ("join", width) not in self.packs.entries and (wanted is None or width in wanted):
                inputs = self.packs.inputs([[0]], width)
                for _ in range(self.batch.run.runs_before_serving):
                    self.packs.through_stages(width, *inputs)

    def _prefill_pack(self, members: list[tuple[SlotRequest, int, int]],
                      slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One pack's prefill through every stage, each prompt's keys and values copied into its row's columns
        before `slot`; returns the prompts' first tokens and what goes to the host for them (`pick`), on the last
        stage's stream."""
        lanes = self.batch.run.lanes
        prompts = [r.prompt for r, _, _ in members]
        per_lane: dict[int, list[tuple[int, int]]] = {}  # lane: (row, prompt length), side by side in the pack
        for request, k, row in members:
            per_lane.setdefault(k, []).append((row, len(request.prompt)))
        # lane: its tokens' span in the pack, its joined rows and their lengths, and each token's row and cache column
        # (host tensors, computed once for every stage)
        spans, begin = {}, 0
        for k, items in per_lane.items():
            row_list, counts = [row for row, _ in items], [n for _, n in items]
            end = begin + sum(counts)
            spans[k] = (begin, end, torch.tensor(row_list), torch.tensor(counts), repeated(row_list, counts),
                        prompt_columns(counts, slot, self.batch.cache_len))
            begin = end
        ends = [end - 1 for end in accumulate(len(p) for p in prompts)]  # each prompt's last token

        def into_rows(j: int, device: torch.device, scratch: LaneCache) -> None:
            for k, (first, end, rows, lengths, token_rows, columns) in spans.items():
                lanes[k].caches[j].take_prompts(scratch, first, end, to_device(token_rows, device),
                                                to_device(columns, device))
                lanes[k].inputs[j].join(to_device(rows, device), to_device(lengths, device), slot)

        # its own width: a prefill's time follows its tokens, padding included (`joins.reused_width` is for riding)
        width = pack_width(begin, self.packs.limit)
        out = self.packs.through_stages(width, *self.packs.inputs(prompts, width), into_rows)
        with self.batch.run.on(len(self.batch.s.stages) - 1):
            last = out[0].index_select(0, on_device(ends, out.device))[:, None, :]  # each prompt's last token
            return self.batch.pick(self.batch.s.head(last)[:, -1].float())
