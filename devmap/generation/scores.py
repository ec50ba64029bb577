"""Log-probabilities of the tokens a model chose or was given, and of its most likely alternatives: what OpenAI's
`logprobs` / `top_logprobs` and `echo` hand back (lm-evaluation-harness scores a model through them).

A score is taken from the model's own distribution over the vocabulary (a log-softmax of its float logits), before
temperature, top-k or top-p shape the choice, as OpenAI's and vLLM's servers report it. A step's scores travel to
the host with its tokens as one tensor per step (`packed`), so scoring costs one log-softmax and one top-k per step
and no extra copy.
"""

from __future__ import annotations

import torch
from torch import nn

from .row_types import Score


def packed(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """Per row of `logits` (rows × vocab, float): the chosen token, its log-probability, the `top` most likely tokens'
    ids and their log-probabilities, as one float64 row (token ids are exact in a float64)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.view(-1, 1))
    best = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1) if top else None
    parts = [tokens.view(-1, 1).double(), chosen.double()]
    if best is not None:
        parts += [best.indices.double(), best.values.double()]
    return torch.cat(parts, dim=-1)


def unpacked(row: list[float], top: int) -> tuple[int, Score]:
    """(token, score) of one row of `packed`'s output, read back on the host."""
    ids, values = row[2:2 + top], row[2 + top:2 + 2 * top]
    return int(row[0]), (row[1], tuple((int(i), v) for i, v in zip(ids, values)))


@torch.no_grad()
def prompt_scores(model: nn.Module, ids: list[int], top: int) -> list[Score | None]:
    """Each prompt token's score given the tokens before it (the first has none: nothing comes before it), from one
    eager pass of the prompt through the model's stages (`forward`, nothing captured or kept)."""
    from .api import forward

    logits = forward(model, torch.tensor([ids], dtype=torch.long), graphs=False, keep_graphs=False)[0, :-1]
    if logits.shape[0] == 0:
        return [None]
    following = torch.tensor(ids[1:], device=logits.device)
    rows = packed(logits, following, top).tolist()
    return [None, *(unpacked(row, top)[1] for row in rows)]
