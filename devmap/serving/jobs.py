"""What a request is on its way through the engine core: its generation parameters, its token-level state, and
what the core hands back for it after each step (`TokenOutput`). Text lives on the API side (`text_stream.py`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..generation.row_types import Score
from .errors import ServiceError
from .kv_budget import KVBudget


DEFAULT_BUDGET = 16  # a request's token budget when it names none (OpenAI's completions API default)


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks for: at most `max_new_tokens` tokens (its token budget; HTTP's `max_tokens`), temperature 0
    is greedy decoding (transformers' tokens). `logprobs`: each new token's log-probability and this many most
    likely alternatives (None: none); `echo`: the prompt's tokens' log-probabilities too (with `logprobs`)."""

    max_new_tokens: int = DEFAULT_BUDGET
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False

    def batch_key(self) -> tuple:
        """Requests batch together when they decode the same way (one sampling setting per generate call) and
        score the same way (a batch computes log-probabilities for all its rows or none)."""
        scoring = (self.logprobs, self.echo)
        if self.temperature == 0:
            return ("greedy", scoring)
        return ("sample", self.temperature, self.top_p, self.top_k, self.seed, scoring)


@dataclass
class Completion:
    """A finished request: its text, why it ended ("stop" or "length") and the token counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Job:
    """One request inside the engine core: its prompt, the tokens it has, whether it ended or its client left."""

    id: int
    model_id: str
    prompt_ids: list[int]
    params: GenerationParams
    arrived: float = field(default_factory=time.perf_counter)
    waiting_since: float = field(default_factory=time.perf_counter)  # arrival, or when its batch stopped under it
    cancelled: threading.Event = field(default_factory=threading.Event)  # aborted: its client left, or a stop string
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    resumed: bool = False  # a batch stopped before it ended, and it waits to continue
    kv_budget: KVBudget | None = None  # the KV cache its model's memory plan made room for (None: unbounded)
    strikes: int = 0  # steps that failed while its prompt ran in them (the core ends it at two, or one alone)
    alone: bool = False  # after such a failure it joins only as the one joiner of a step (so a second one is its)
    prompt_scored: bool = False  # its prompt's log-probabilities were handed back (echo)

    @property
    def budget_left(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_new_tokens - len(self.generated)


@dataclass
class TokenOutput:
    """What the core hands back for one request after a step: its new tokens, in order, and, once it ended, why
    ("stop": an end-of-sequence token, which is not among the tokens; "length": its token budget) or the error
    that ended it."""

    request_id: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: ServiceError | None = None
    scores: list[Score] = field(default_factory=list)  # each token's, where the request asked for logprobs
    prompt_scores: list[Score | None] | None = None  # the prompt's (echo; its first token has none), once

    def merge(self, later: TokenOutput) -> None:
        """Add a later output of the same request (an API that fell behind reads several steps at once)."""
        self.tokens.extend(later.tokens)
        self.scores.extend(later.scores)
        self.prompt_scores = self.prompt_scores if later.prompt_scores is None else later.prompt_scores
        self.finish_reason = later.finish_reason or self.finish_reason
        self.error = later.error or self.error
