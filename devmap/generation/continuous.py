"""Continuous batching over devmap's lanes: a fixed set of rows decodes step after step, and a new request takes a
free row between two steps instead of waiting for the whole batch to end.

A batch starts with empty rows. Before a step, the requests that join (the first ones too) are prefilled through
every stage in sub-groups of similar lengths (a captured step per bucketed sub-group shape), each one's keys and
values copied into its row's columns right before the lanes' shared cache slot; its row's mask and position offset
are reset on every stage, and its first token replaces the row's input of the next step. All of it is issued in
stream order between the lanes' steps, so decode steps stay the same replayed graphs (one capture per rows × cache
length) and the host never waits for a GPU beyond the token hand-back's lag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
import itertools
from typing import Any, Callable

import torch
from torch import nn

from .api import check_length
from .causal_lm import CausalLMStages
from ..errors import UsageError
from .joins import arena_tokens, group_context, join_groups, join_shapes, on_device, padded_prompts, to_device
from .lane_cache import LaneCache
from .lane_runner import EOS_CHECK_LAG, LaneRunner, record_event, split_lanes
from .sampling import Sampling, choose
from .step_cache import StepCache, step_cache, weight_pointers
from ..pipelining.streams import copy_later, hand_off, to_host

KEPT_SHAPES = 2  # (rows, cache length) shapes whose captured steps and KV caches stay on the model


@dataclass
class SlotRequest:
    """A request for a row: its prompt (token ids), how many tokens it may generate, and whom they go to."""

    prompt: list[int]
    max_new: int
    owner: Any


Admit = Callable[[int, int, int], "list[SlotRequest] | None"]
"""(free rows, the longest prompt that fits now, the most new tokens that fit now) -> the requests that start now
(at most the free rows, each fitting), or None to end the run here (its unfinished owners are returned)."""
Emit = Callable[[Any, int], bool]
"""(owner, token) -> True when the owner needs no more tokens (it ended, or went away): its row becomes free."""


@torch.no_grad()
def generate_continuous(model: nn.Module, first: list[SlotRequest], admit: Admit, emit: Emit, *, rows: int,
                        first_slot: int, cache_len: int, lanes: int | None = None, sampling: Sampling | None = None,
                        split_layers: list[int] | None = None, graphs: bool = True, compile: bool = False,
                        keep_graphs: bool = True, stats: dict[str, float] | None = None) -> list[Any]:
    """Generate for `first`, and for every request `admit` hands in while the batch runs, each in one of `rows` rows
    (a row an earlier request freed); every token goes to `emit` in order (a couple of steps behind the GPUs).

    Each row's cache holds `cache_len` tokens, its columns reused around the cache's end (keys carry their positions,
    attention ignores column order). The lanes decode from slot `first_slot`; a request (the first ones too) needs a
    prompt of at most `first_slot` tokens and prompt + max_new - 1 ≤ cache_len, whenever it joins, so a batch runs
    as long as requests come (`admit` gets first_slot and cache_len - first_slot + 1 as the longest prompt and the
    most new tokens that fit). Ends when every row is free and `admit`
    brings none, or when `admit` returns None; returns the owners that had not finished then (to continue
    elsewhere, from their prompt plus the tokens they got). Greedy tokens equal `devmap.generate` of each request
    alone. `stats`, when given, gets the run's steps, joined requests and the host seconds spent issuing them."""
    sampling = sampling or Sampling()
    sampling.check()
    if not first or len(first) > rows:
        raise UsageError(f"a continuous batch starts with 1 to rows={rows} requests, got {len(first)}")
    for request in first:
        if not request.prompt or request.max_new < 1:
            raise UsageError("every request needs a non-empty prompt and max_new >= 1")
    for request in first:
        if len(request.prompt) > first_slot or len(request.prompt) + request.max_new - 1 > cache_len:
            raise UsageError(f"first_slot={first_slot} and cache_len={cache_len} do not hold a prompt of "
                             f"{len(request.prompt)} tokens and {request.max_new} new ones")
    stages = CausalLMStages(model, split_layers)
    check_length(model.config, cache_len)
    stages.check_window(cache_len)
    stages.float_mask_dtype()
    # the lanes start empty: each row attends to one (zero) column before the first slot, so that rows nobody
    # holds decode finite garbage; every request, the first ones too, comes in through a joining group's prefill
    ids = torch.zeros((rows, 1), dtype=torch.long)
    lane_list = split_lanes(stages, ids, torch.ones_like(ids), lanes, default=len(stages.stages))
    run = LaneRunner(stages, lane_list, graphs, compile)
    cache = step_cache(model, "continuous", KEPT_SHAPES) if run.graphs and keep_graphs else StepCache()
    entries = cache.use((run.layout(), tuple(lane.ids.shape[0] for lane in lane_list), cache_len),
                        weight_pointers(model))
    batch = ContinuousBatch(run, first_slot, cache_len, sampling, emit, cache, entries)
    with stages.hooks_bypassed():
        for k, lane in enumerate(lane_list):
            run.prepare_decode(k, lane, cache_len, entries, cache)
            for j, inputs in enumerate(lane.inputs):
                inputs.reset(lane.mask, first_slot - 1)
                lane.caches[j].start_decoding(first_slot)
        if run.graphs:
            batch.capture_joins()
        unfinished = batch.generate(first, admit)
        run.streams.join([])
    if stats is not None:
        stats.update(batch.stats)
    return unfinished


class ContinuousBatch:
    """The rows of one continuous run: who holds each row as work is issued, and as tokens come back."""

    def __init__(self, run: LaneRunner, first_slot: int, cache_len: int, sampling: Sampling, emit: Emit,
                 cache: StepCache, entries: dict[Any, Any]) -> None:
        self.run, self.s = run, run.s
        self.cache, self.entries = cache, entries  # captured steps kept for this batch shape (joining groups')
        self.first_slot, self.cache_len = first_slot, cache_len
        self.sampling, self.emit = sampling, emit
        head = self.s.head_device
        self.generator = torch.Generator(device=head).manual_seed(sampling.seed) if sampling.do_sample else None
        self.lag = EOS_CHECK_LAG if head.type == "cuda" else 0
        self.issued = [[None] * lane.ids.shape[0] for lane in run.lanes]  # per lane and row: whom the row's next
        self.heard = [[None] * lane.ids.shape[0] for lane in run.lanes]  # tokens are for, as issued and as heard back
        # per lane and row: tokens still to issue, and to hand over, for its holder (a row never runs past its
        # request's max_new: its columns would wrap onto its own prompt)
        self.to_issue = [[0] * lane.ids.shape[0] for lane in run.lanes]
        self.to_hear = [[0] * lane.ids.shape[0] for lane in run.lanes]
        # per lane, in issue order: (step, event, host tokens, None) for a step's tokens of every row, and
        # (step, event, host tokens, [(row, request, index in the tokens)]) for joining requests' first tokens
        self.pending: list[list[tuple[int, Any, torch.Tensor, Any]]] = [[] for _ in run.lanes]
        self.stats = {"steps": 0, "joined": 0, "join_seconds": 0.0}

    def generate(self, first: list[SlotRequest], admit: Admit) -> list[Any]:
        self.run.start()
        for step in itertools.count(1):
            self.deliver(step - 1 - self.lag)
            slot = self.first_slot + step - 1  # where this step writes its input token
            self.stats["steps"] = step
            free = self.free_rows()
            joining = first if step == 1 else admit(len(free), self.first_slot, self.cache_len - self.first_slot + 1)
            if joining is None:
                break
            if len(joining) > len(free):
                raise ValueError(f"admit returned {len(joining)} requests for {len(free)} free rows")
            began = time.perf_counter()
            if joining:
                self.join([(request, k, row) for request, (k, row) in zip(joining, free)], step, slot)
            self.stats["joined"] += len(joining) if step > 1 else 0
            self.stats["join_seconds"] += time.perf_counter() - began
            if all(owner is None for held in self.issued for owner in held):
                break
            for k, lane in enumerate(self.run.lanes):
                self.finish(k, self.run.decode_step(lane), step)
                self.count_issued(k)
        self.deliver(None)
        return [owner for held in self.heard for owner in held if owner is not None]

    def count_issued(self, k: int, rows: list[int] | None = None) -> None:
        """One more token issued for lane k's held rows (or `rows`): a row whose request has all its tokens issued
        is free for the next joiner (its last tokens still reach its owner)."""
        for row in range(len(self.issued[k])) if rows is None else rows:
            if self.issued[k][row] is not None:
                self.to_issue[k][row] -= 1
                if self.to_issue[k][row] <= 0:
                    self.issued[k][row] = None

    def free_rows(self) -> list[tuple[int, int]]:
        """(lane, row) of every free row, the lanes taking turns (joiners spread over the lanes)."""
        free = [[(k, row) for row, owner in enumerate(held) if owner is None] for k, held in enumerate(self.issued)]
        return [item for turn in itertools.zip_longest(*free) for item in turn if item is not None]

    def finish(self, k: int, logits: torch.Tensor, step: int) -> None:
        """The lane's next tokens (on the last stage's stream): to the host, and to stage 0 for the next step."""
        lane = self.run.lanes[k]
        with self.run.on(len(self.s.stages) - 1) as compute:
            token = choose(logits, self.sampling, self.generator)
            host = to_host(token)
            event = record_event(compute)
        self.pending[k].append((step, event, host, None))
        lane.token_ready = copy_later(lane.steps[0].static_in.view(-1), token, event, 0, self.run.streams)

    def join(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> None:
        """Start each (request, lane, row) before the lanes' step `step`, which writes cache slot `slot`: prefills of
        them in sub-groups of similar lengths (a captured step per bucketed sub-group shape, padded with copies of
        its first prompt), their keys and values copied into their rows, their first tokens into their rows'
        inputs. Stage j runs sub-group g while stage j + 1 runs g - 1."""
        for request, _, _ in joining:
            length = len(request.prompt)
            if not 0 < length <= self.first_slot or not 1 <= request.max_new <= self.cache_len - length + 1:
                raise ValueError(f"a request of {length} prompt tokens and {request.max_new} new ones does not fit a "
                                 f"batch of first slot {self.first_slot} and a {self.cache_len}-token cache")
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
            self.issued[k][row], self.to_issue[k][row] = request.owner, request.max_new
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

    def deliver(self, limit: int | None) -> None:
        """Hand every token of the steps up to `limit` (None: all issued) to its row's owner, in order."""
        for k, queue in enumerate(self.pending):
            while queue and (limit is None or queue[0][0] <= limit):
                _, event, host, joined = queue.pop(0)
                if event is not None:
                    event.synchronize()
                tokens = host.tolist()
                if joined is not None:
                    for row, request, index in joined:
                        self.heard[k][row], self.to_hear[k][row] = request.owner, request.max_new
                        self._give(k, row, tokens[index])
                    continue
                for row, token in enumerate(tokens):
                    if self.heard[k][row] is not None:
                        self._give(k, row, token)

    def _give(self, k: int, row: int, token: int) -> None:
        owner = self.heard[k][row]
        self.to_hear[k][row] -= 1
        if self.emit(owner, token) or self.to_hear[k][row] <= 0:
            self.heard[k][row] = None
            if self.issued[k][row] is owner:
                self.issued[k][row] = None


def _onto(x: torch.Tensor, event: Any, device: torch.device, j: int, streams: Any, compute: Any) -> torch.Tensor:
    """`x` (ready once `event` fires) usable on stage j's `compute` stream of `device` (None on a CPU)."""
    return hand_off(x, event, device, j, streams, compute) if compute is not None else x.to(device)
