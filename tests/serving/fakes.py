"""A stand-in model for the engine core: continuous batches that keep the real batch's contract (the checks of
`ContinuousBatch.check`, the context bound of `check_length`, no more joiners than free rows) and make each next token
from the tokens before it, so a request's tokens are the same whichever batch, row or resume it runs in; and prompt
scores. Tests drive the real EngineCore, scheduler and batch runner over it, without a model."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from torch import nn

from devmap.errors import UsageError
from devmap.generation.row_types import SlotRequest, StepFailed
from devmap.serving.resident import ResidentModel

EOS = 2
VOCAB = 64


def next_token(tokens: list[int]) -> int:
    """The stand-in model's greedy token after `tokens` (an end-of-sequence now and then)."""
    return (sum(tokens) * 31 + len(tokens) * 7 + tokens[-1]) % (VOCAB - 3) + 3 if len(tokens) % 151 else EOS


def alone(prompt: list[int], budget: int) -> list[int]:
    """The tokens a request gets by itself (up to an end-of-sequence, which it does not keep, or its budget)."""
    tokens, out = list(prompt), []
    while len(out) < budget:
        token = next_token(tokens)
        if token == EOS:
            break
        out.append(token)
        tokens.append(token)
    return out


class FakeBatch:
    """A continuous batch of `rows` rows over the stand-in model (see the module). `fail_on`: a prompt token that
    makes the step its prompt runs in fail."""

    def __init__(self, rows: int, first_slot: int, cache_len: int, context: int, fail_on: int | None,
                 seen: list) -> None:
        if rows < 1 or not 0 < first_slot <= cache_len:
            raise UsageError(f"rows={rows}, first_slot={first_slot}, cache_len={cache_len}")
        if context and cache_len > context:
            raise UsageError(f"prompt + new tokens = {cache_len} is more than the model's context of {context}")
        self.first_slot, self.cache_len, self.fail_on = first_slot, cache_len, fail_on
        self.held: list[dict | None] = [None] * rows  # per row: owner, tokens so far, tokens left to issue
        self.pending: list[tuple[Any, int]] = []
        self.mixing = False
        self.stats = {"steps": 0, "joined": 0, "join_seconds": 0.0}
        seen.append((rows, first_slot, cache_len))

    def free_rows(self) -> list[tuple[int, int]]:
        return [(0, r) for r, row in enumerate(self.held) if row is None]

    def free_count(self) -> int:
        return sum(row is None for row in self.held)

    def step(self, joining: list[SlotRequest]) -> bool:
        free = self.free_rows()
        if len(joining) > len(free):
            raise UsageError(f"{len(joining)} joining with {len(free)} free rows")
        if not joining and all(row is None for row in self.held):
            return False
        self.stats["steps"] += 1
        for request in joining:
            length = len(request.prompt)
            if not 0 < length <= self.first_slot or not 1 <= request.max_new_tokens <= self.cache_len - length + 1:
                raise StepFailed([r.owner for r in joining], UsageError(
                    f"first_slot={self.first_slot} and cache_len={self.cache_len} do not hold a prompt of {length} "
                    f"tokens and {request.max_new_tokens} new ones"))
            if self.fail_on is not None and self.fail_on in request.prompt:
                raise StepFailed([r.owner for r in joining], IndexError("index out of range in self"))
        for request, (_, r) in zip(joining, free):
            self.held[r] = {"owner": request.owner, "tokens": list(request.prompt), "left": request.max_new_tokens}
        for r, row in enumerate(self.held):
            if row is not None:
                token = next_token(row["tokens"])
                row["tokens"].append(token)
                row["left"] -= 1
                self.pending.append((row["owner"], token))
                if row["left"] <= 0:
                    self.held[r] = None
        return True

    def collect(self, everything: bool = False, scored: bool = False) -> list[tuple]:
        out, self.pending = self.pending, []
        return [(owner, token, None) for owner, token in out] if scored else out

    def release(self, owner: Any) -> None:
        self.held = [None if row is not None and row["owner"] is owner else row for row in self.held]

    def unfinished(self) -> list[Any]:
        return [row["owner"] for row in self.held if row is not None]

    def join_shapes(self) -> list[tuple[int, int]]:
        """One pack width met, joining apart (a stand-in for the steps a batch made)."""
        return [(0, 64)]

    def busy(self) -> list[tuple]:
        """One stage on one device, busy half of each step's time (a stand-in for the sampled GPU windows)."""
        return [(0, "cuda:0", 0.5, 1.0)] if self.stats["steps"] % 4 == 0 else []


class FakeBatches:
    """`Batches` over the stand-in model; `shapes` records every batch's (rows, first slot, cache length), `delay`
    slows each step (seconds) so that requests arrive while batches run."""

    def __init__(self, fail_on: int | None = None, delay: float = 0.0) -> None:
        self.fail_on, self.delay = fail_on, delay
        self.shapes: list[tuple[int, int, int]] = []

    @contextlib.contextmanager
    def open(self, resident: ResidentModel, shape: Any, sampling: Any, scores: int | None):
        batch = FakeBatch(shape.rows, shape.first_slot, shape.cache_len, resident.context, self.fail_on,
                          self.shapes)
        if self.delay:
            step = batch.step
            batch.step = lambda joining: time.sleep(self.delay) or step(joining)
        yield batch

    def prompt_scores(self, resident: ResidentModel, ids: list[int], top: int) -> list:
        return [None] + [(-1.0, ())] * (len(ids) - 1)


def fake_resident(model_id: str = "m", context: int = 256, rows: int = 64) -> ResidentModel:
    """A resident stand-in model whose plan holds `rows` rows of `context` cache tokens."""
    return ResidentModel(id=model_id, path=Path("."), model=nn.Module(), tokenizer=None, created=0, context=context,
                         vocab_size=VOCAB, planned={}, report={}, max_rows=rows, cache_len=context, eos_ids=(EOS,))


class Collected:
    """Every output the core delivers, per request id: tokens, how it ended, its error."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, Any] = {}
        self.done = threading.Condition()

    def __call__(self, outputs: list) -> None:
        with self.done:
            for out in outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.tokens)
                if out.finish_reason is not None or out.error is not None:
                    self.ended[out.request_id] = out.error or out.finish_reason
            self.done.notify_all()

    def wait(self, ids: list[int], timeout: float) -> bool:
        with self.done:
            return self.done.wait_for(lambda: all(i in self.ended for i in ids), timeout)
