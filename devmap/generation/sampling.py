"""How the next token is chosen from a lane's logits: greedy, or temperature, then top-k, then top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError


@dataclass
class Sampling:
    """How the next token is chosen."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature <= 0:
            raise UsageError(f"temperature must be positive, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UsageError(f"top_k must be >= 0 and top_p in (0, 1], got {self.top_k} and {self.top_p}")


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row (logits: rows × vocab, float)."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > sampling.top_p  # keep the first token past top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
