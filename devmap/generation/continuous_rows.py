"""The rows of a continuous batch: who holds each row as work is issued and as tokens come back, the decode steps,
and the tokens' way back to their owners. Requests join through one joining strategy chosen when the batch is made:
prefills of their own between two steps (`join_prefill.JoinApart`), or riding the decode steps
(`mixed_joins.Riding`), both over the batch's packed prompts (`packs.Packs`). All of it is issued in stream order
between the lanes' steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import UsageError
from .join_prefill import JoinApart
from .joins import JoinShape
from .mixed_joins import Riding
from .packs import Packs
from .lane_decode import computed_rows
from .lane_runner import EOS_CHECK_LAG, LaneRunner
from .row_types import Row, SlotRequest, StepFailed
from .sampling import Sampling, choose
from .scores import packed, unpacked
from .step_cache import StepCache
from ..pipelining.streams import copy_later, to_host


class ContinuousBatch:
    """The rows of one continuous batch (made by `continuous_batch`): who holds each row as work is issued, and as
    tokens come back. Requests join inside the decode steps where every layer is joined and `mixing` says so
    (`joins` is a `mixed_joins.Riding`), else through prefills of their own between two steps (a
    `join_prefill.JoinApart`)."""

    def __init__(self, run: LaneRunner, first_slot: int, cache_len: int, sampling: Sampling, cache: StepCache,
                 entries: dict[Any, Any], mixing: bool, scores: int | None = None) -> None:
        self.run, self.s = run, run.s
        self.cache, self.entries = cache, entries  # captured steps kept for this batch shape (joining packs')
        self.first_slot, self.cache_len = first_slot, cache_len
        self.sampling = sampling
        head = self.s.head_device
        self.generator = torch.Generator(device=head).manual_seed(sampling.seed) if sampling.do_sample else None
        self.lag = EOS_CHECK_LAG if head.type == "cuda" else 0
        self.rows = [[Row() for _ in range(lane.ids.shape[0])] for lane in run.lanes]  # per lane, per row
        # per lane, in issue order: (step, event, host tokens, None) for a step's tokens of every row, and
        # (step, event, host tokens, [(row, request, index in the tokens)]) for joining requests' first tokens
        self.pending: list[list[tuple[int, Any, torch.Tensor, Any]]] = [[] for _ in run.lanes]
        self.steps = 0
        self.last_step = [0 for _ in run.lanes]  # per lane, the last step it ran in (a lane nobody holds sits out)
        self.mixing = mixing  # joiners ride in the decode steps (every layer joined: `CausalLMStages.mixes`)
        self.packs = Packs(run, entries, cache, cache_len)
        self.joins: JoinApart | Riding = Riding(self, self.packs) if mixing else JoinApart(self, self.packs)
        self.stats = {"steps": 0, "joined": 0, "join_seconds": 0.0}
        self.scores = scores  # each token's log-probability and this many alternatives' (None: no scores)

    @property
    def longest_prompt(self) -> int:
        """The longest prompt a request may bring (the lanes' first slot)."""
        return self.first_slot

    @property
    def most_new_tokens(self) -> int:
        """The most tokens a request may ask for (its prompt's columns and its own never overlap in the cache)."""
        return self.cache_len - self.first_slot + 1

    def check(self, request: SlotRequest) -> None:
        """Refuse a request this batch cannot hold (UsageError naming the sizes)."""
        length = len(request.prompt)
        if not 0 < length <= self.first_slot or not 1 <= request.max_new_tokens <= self.cache_len - length + 1:
            raise UsageError(f"first_slot={self.first_slot} and cache_len={self.cache_len} do not hold a prompt of "
                             f"{length} tokens and {request.max_new_tokens} new ones")

    @torch.no_grad()
    def step(self, joining: list[SlotRequest] | None = None) -> bool:
        """Start `joining` in free rows (each fitting: see `check`), then issue one decode step of every lane with rows
        to decode (a lane nobody holds sits the step out). False, and nothing issued, when no row is held and none
        joins: the batch has drained.

        A step that fails raises `StepFailed` naming the owners whose prompts ran in it (its suspects); the batch is
        not to be stepped again (its rows may be half joined), but `collect(everything=True)` still hands back
        the tokens of the steps before it."""
        joining = joining or []
        free = self.free_rows() if joining else []  # in the order joiners take them (most steps take none)
        if len(joining) > len(free):
            raise UsageError(f"{len(joining)} requests joining a batch with {len(free)} free rows")
        if not joining and all(row.issued_to is None for lane in self.rows for row in lane):
            return False
        prompts: list[Any] = []  # owners whose prompts run in this step
        try:
            self._step(joining, free, prompts)
        except Exception as exc:
            raise StepFailed(prompts, exc) from exc
        return True

    def _step(self, joining: list[SlotRequest], free: list[tuple[int, int]], prompts: list[Any]) -> None:
        """`step`'s work; `prompts` gets the owners whose prompts run in it before they do."""
        self.steps += 1
        step, slot = self.steps, self.first_slot + self.steps - 1  # the slot this step writes its input token to
        self.stats["steps"] = step
        self.run.clock.begin_step(step)
        began = time.perf_counter()
        placed = [(request, k, row) for request, (k, row) in zip(joining, free)]
        # the rows decoding this step: held, their prompts in place (a rider's first token comes out of the step)
        running = [[r for r, row in enumerate(lane) if row.issued_to is not None and not row.queued]
                   for lane in self.rows]
        prompts.extend(request.owner for request, _, _ in placed)
        riders = self.joins.take(placed, step, slot)  # joined now (apart), or the queued ones this step carries
        prompts.extend(request.owner for lane_riders in riders.values() for request, _ in lane_riders)
        if placed and not self.mixing:  # joined apart: their rows decode in this step
            running = [[r for r, row in enumerate(lane) if row.issued_to is not None] for lane in self.rows]
        self.stats["joined"] += len(joining) if step > 1 else 0
        self.stats["join_seconds"] += time.perf_counter() - began
        for k, lane in enumerate(self.run.lanes):
            if not running[k] and k not in riders:
                continue  # nobody's rows: the lane sits the step out (its slot catches up when a request joins it)
            if self.last_step[k] != step - 1:
                for j, lane_cache in enumerate(lane.caches):
                    with self.run.on(j):
                        lane_cache.place_at(slot)
            self.last_step[k] = step
            rows = computed_rows(running[k][-1] if running[k] else -1, lane.ids.shape[0])
            if k in riders:
                logits, first, first_host = self.joins.ride(k, riders[k], rows, slot)
            else:
                steps = self.run.decode.first_rows_steps(lane, rows, self.cache) if rows < lane.ids.shape[0] else None
                logits = self.run.decode.decode_step(lane, steps)
            self.finish(k, logits, step)
            self.count_issued(k, running[k])
            if k in riders:
                self.joins.hand_in(k, riders[k], first, first_host, step)

    def recompile(self) -> None:
        """From the next step on, run compiled steps (its model's regions through torch.compile, which a compile
        beside serving has made ready): every step is made anew over the same buffers and KV caches, so the rows,
        their caches and the tokens still coming back stay as they are; each step is captured again at its second
        use, as a new shape's steps are. The steps issued so far run to their end first (their graphs go)."""
        if self.run.compile:
            return
        for device in {stage.device for stage in self.s.stages}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.run.compile = True
        self.cache.new_pools()  # the old steps' graphs go with them: their pools cannot take new captures
        for lane in self.run.lanes:
            self.run.decode.remake_steps(lane, self.cache)
        self.packs.forget_steps()

    def join_shapes(self) -> list[JoinShape]:
        """The join shapes (`joins.JoinShape`) this batch's steps met so far, with those kept for its shape from earlier
        batches: what a batch of its shape makes up front where `continuous_batch(join_shapes=...)` gets them."""
        return self.joins.shapes()

    def collect(self, everything: bool = False, scored: bool = False) -> list[tuple]:
        """(owner, token) of every token back from the steps up to the lag (`everything`: all issued steps, waiting
        for them), in order; (owner, token, score) with `scored` (the score None unless the batch scores its
        tokens). An owner may get tokens after it ended (issued before `release`): ignore them."""
        out: list[tuple[Any, int, Any]] = []
        self.deliver(None if everything else self.steps - self.lag, out)
        return out if scored else [(owner, token) for owner, token, _ in out]

    def busy(self) -> list[tuple[int, torch.device, float, float]]:
        """(stage, its device, busy seconds, span seconds) of each stage in the sampled windows of steps timed since
        the last call whose work has happened (`busy.BusyClock`; nothing on CPUs)."""
        return [(j, self.s.stages[j].device, busy, span) for j, busy, span in self.run.clock.harvest()]

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' next tokens, what goes to the host for them: the tokens, or with their scores `packed`) from
        float logits, on the current stream."""
        token = choose(logits, self.sampling, self.generator)
        return token, token if self.scores is None else packed(logits, token, self.scores)

    def release(self, owner: Any) -> None:
        """`owner` needs no more tokens (it ended, or went away): its row is free for the next joiner."""
        self.joins.drop(owner)
        for k, lane in enumerate(self.rows):
            for r, row in enumerate(lane):
                if row.heard_by is owner:
                    row.heard_by = None
                if row.issued_to is owner:
                    self.vacate(k, r)

    def unfinished(self) -> list[Any]:
        """The owners still holding rows, or waiting for a step to carry their prompts (to continue elsewhere, from
        their prompt plus the tokens they got)."""
        return [*(row.heard_by for lane in self.rows for row in lane if row.heard_by is not None),
                *self.joins.waiting()]

    def count_issued(self, k: int, rows: list[int] | None = None) -> None:
        """One more token issued for lane k's held rows whose prompts ran (or `rows`): a row whose request has all
        its tokens issued is free for the next joiner (its last tokens still reach its owner)."""
        lane = self.rows[k]
        for r in rows if rows is not None else range(len(lane)):
            if lane[r].issued_to is not None and not lane[r].queued:
                lane[r].to_issue -= 1
                if lane[r].to_issue <= 0:
                    self.vacate(k, r)

    def vacate(self, k: int, r: int) -> None:
        """Lane k's row r is issued no more work for its request: free for the next joiner, and until one comes its
        steps on every stage read no keys and values (issued on the stages' streams, after its last step)."""
        self.rows[k][r].issued_to, self.rows[k][r].queued = None, False
        for j, inputs in enumerate(self.run.lanes[k].inputs):
            with self.run.on(j):
                inputs.vacate(r)

    def free_rows(self) -> list[tuple[int, int]]:
        """(lane, row) of every free row, in the order joiners take them: each next joiner goes to the lane holding the
        fewest rows (the first of those), so the lanes stay even. At equal rows in flight the weight read is the same
        whichever way they split (a pipeline reads each stage's weights once per lane), but even lanes overlap the
        stages' prefill work (the joiners' prompts each lane's steps carry) and keep every stage's step short; a lane
        nobody holds sits its steps out."""
        order = []
        for k, lane in enumerate(self.rows):
            held = sum(row.issued_to is not None for row in lane)
            free = (r for r, row in enumerate(lane) if row.issued_to is None)
            order.extend((held + i, k, r) for i, r in enumerate(free))
        order.sort()
        return [(k, r) for _, k, r in order]

    def free_count(self) -> int:
        """How many rows are free (what admitting joiners needs, without `free_rows`' order)."""
        return sum(row.issued_to is None for lane in self.rows for row in lane)

    def finish(self, k: int, logits: torch.Tensor, step: int) -> None:
        """The lane's next tokens (on the last stage's stream): to the host, and to stage 0 for the next step."""
        lane = self.run.lanes[k]
        with self.run.on(len(self.s.stages) - 1) as compute:
            token, payload = self.pick(logits)
            host = to_host(payload)
            event = self.run.record(compute)
        self.pending[k].append((step, event, host, None))  # the first rows' tokens: every held row's
        lane.token_ready = copy_later(lane.steps[0].static_in.view(-1)[:token.shape[0]], token, event, 0,
                                      self.run.streams)

    def deliver(self, limit: int | None, out: list[tuple[Any, int, Any]]) -> None:
        """Append (owner, token, score or None) of every token of the steps up to `limit` (None: all issued) to `out`,
        in order."""
        for k, queue in enumerate(self.pending):
            lane = self.rows[k]
            while queue and (limit is None or queue[0][0] <= limit):
                _, event, host, joined = queue.pop(0)
                if event is not None:
                    event.synchronize()
                tokens = host.tolist()
                if self.scores is not None:
                    tokens = [unpacked(row, self.scores) for row in tokens]
                if joined is not None:
                    for r, request, index in joined:
                        lane[r].heard_by, lane[r].to_hear = request.owner, request.max_new_tokens
                        self._give(lane[r], tokens[index], out)
                    continue
                for row, token in zip(lane, tokens):  # a step over the first rows had every row still owed one
                    if row.heard_by is not None:
                        self._give(row, token, out)

    @staticmethod
    def _give(row: Row, token: Any, out: list[tuple[Any, int, Any]]) -> None:
        """Hand `token` (an id, or (id, score)) to the row's owner; after its last token the row is heard by nobody
        (its issuing ended earlier, in `count_issued`, and the row may serve another request already)."""
        out.append((row.heard_by, *token) if isinstance(token, tuple) else (row.heard_by, token, None))
        row.to_hear -= 1
        if row.to_hear <= 0:
            row.heard_by = None


