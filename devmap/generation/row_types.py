"""What the rows of a continuous batch hold: the request a row serves, the row's bookkeeping, and a token's score. No
torch here: the service's API process imports these types without the model stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Score = tuple[float, tuple[tuple[int, float], ...]]
"""A token's log-probability, and the `top` most likely tokens with theirs (most likely first): `generation.scores`."""


@dataclass
class SlotRequest:
    """A request for a row: its prompt (token ids), how many tokens it may generate, and whom they go to."""

    prompt: list[int]
    max_new_tokens: int
    owner: Any


@dataclass
class Row:
    """One row of a continuous batch: whom its next tokens are for as work is issued (`issued_to`) and as tokens
    come back (`heard_by`, a couple of steps later), and how many tokens are still to issue and to hand back for
    them (a row never runs past its request's max_new_tokens: its columns would wrap onto its own prompt)."""

    issued_to: Any = None
    heard_by: Any = None
    to_issue: int = 0
    to_hear: int = 0
    queued: bool = False  # taken by a joiner whose prompt waits for a step to carry it (`mixed_joins`)


class StepFailed(RuntimeError):
    """A continuous batch's step failed (`cause`, also its `__cause__`); `owners`: those whose prompts ran in it
    (joining, or riding it), the only requests the step did for the first time."""

    def __init__(self, owners: list[Any], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.owners, self.cause = owners, cause
