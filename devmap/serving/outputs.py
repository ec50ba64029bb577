"""What the engine core hands back after each step: every request's new tokens (with their scores where it asked
for log-probabilities), and why a request ended, gathered per request and handed to the API side as one list."""

from __future__ import annotations

import threading
from typing import Callable

from ..generation.row_types import Score
from .errors import ServiceError
from .jobs import Job, TokenOutput

Deliver = Callable[[list[TokenOutput]], None]
"""Takes each step's outputs (called from the core's thread)."""


class StepOutputs:
    """This step's outputs by request id, and the index of the requests not yet ended (`live`, shared with the
    threads that abort requests)."""

    def __init__(self, deliver: Deliver) -> None:
        self.deliver = deliver
        self.live: dict[int, Job] = {}  # every request not yet ended, by id
        self.lock = threading.Lock()
        self._outputs: dict[int, TokenOutput] = {}

    def token(self, job: Job, token: int, score: Score | None) -> None:
        """A new token of the request's (its score where it asked for log-probabilities)."""
        out = self.output(job)
        out.tokens.append(token)
        if score is not None and job.params.logprobs is not None:
            out.scores.append(score)

    def end(self, job: Job, reason: str | None = None, error: ServiceError | None = None) -> None:
        """The request ended: its last output says why (an aborted one gets none)."""
        job.finished = True
        with self.lock:
            self.live.pop(job.id, None)
        if not job.cancelled.is_set() and (reason or error):
            out = self.output(job)
            out.finish_reason, out.error = reason, error

    def output(self, job: Job) -> TokenOutput:
        out = self._outputs.get(job.id)
        if out is None:
            out = self._outputs[job.id] = TokenOutput(job.id)
        return out

    def flush(self) -> None:
        """This step's outputs to `deliver`, as one list."""
        if self._outputs:
            outputs, self._outputs = list(self._outputs.values()), {}
            self.deliver(outputs)
