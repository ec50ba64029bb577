"""Token scores in OpenAI's two shapes: the completions API's `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset; what lm-evaluation-harness reads, with `echo` for the prompt's tokens) and the chat API's
`logprobs.content` (token, logprob, bytes, top_logprobs). Each token's text is read in context (the token before it
decoded with it), so a word's leading space stays on its token as OpenAI's servers show it."""

from __future__ import annotations

from typing import Any

from ..generation.row_types import Score


class TokenTexts:
    """Token ids to the text each adds after the token before it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token: int, before: int | None) -> str:
        if before is None:
            return self.tokenizer.decode([token])
        return self.tokenizer.decode([before, token])[len(self.tokenizer.decode([before])):]


def completion_logprobs(texts: TokenTexts, ids: list[int], scores: list[Score | None], before: int | None = None,
                        offset: int = 0) -> dict[str, list]:
    """The completions API's `logprobs` for tokens `ids` with their `scores` (None for a token without one: a prompt's
    first), the token before them `before`, their text starting at character `offset` of the choice's text."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, score in zip(ids, scores):
        text = texts.text(token, before)
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        body["token_logprobs"].append(None if score is None else score[0])
        body["top_logprobs"].append(None if score is None else
                                    {texts.text(other, before): value for other, value in score[1]})
        offset += len(text)
        before = token
    return body


def chat_logprobs(texts: TokenTexts, ids: list[int], scores: list[Score], before: int | None = None) -> dict:
    """The chat API's `logprobs` for tokens `ids` with their `scores`, the token before them `before`."""
    content = []
    for token, (value, top) in zip(ids, scores):
        text = texts.text(token, before)
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()),
                        "top_logprobs": [_entry(texts.text(other, before), other_value) for other, other_value in top]})
        before = token
    return {"content": content}


def _entry(text: str, value: float) -> dict[str, Any]:
    return {"token": text, "logprob": value, "bytes": list(text.encode())}
