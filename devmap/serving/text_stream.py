"""From a request's tokens to its text stream, on the API side: incremental decoding and stop strings. The engine
core ends a request at an end-of-sequence token or its token budget; a stop string is text, so the API ends the
request here and tells the core to abort it (as vLLM's detokenizer does)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ..generation.row_types import Score
from .jobs import GenerationParams


@dataclass
class RequestStream:
    """One request as the API sees it: its tokens so far, its text, and the events its reader gets on `loop`:
    ("text", str), ("done", finish reason) or ("error", ServiceError)."""

    id: int
    model_id: str
    prompt_ids: list[int]
    params: GenerationParams
    tokenizer: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    heard: bool = False  # the core has handed back something for it (it left the queue)
    text: str = ""  # decoded so far (up to the last complete character)
    sent: str = ""  # emitted so far (a prefix of text)
    decoded: tuple[int, int] = (0, 0)  # token offsets: start of the decode window, end of what text covers
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    stopped: bool = False  # a stop string ended it
    scores: list[Score] = field(default_factory=list)  # each generated token's (where it asked for logprobs)
    prompt_scores: list[Score | None] | None = None  # its prompt's tokens' (echo with logprobs)
    scores_sent: int = 0  # scores a stream's chunks carried so far

    def emit(self, *event: Any) -> None:
        self.events.put_nowait(event)


def decode_new(stream: RequestStream, tokenizer: Any, final: bool = False) -> None:
    """Extend `stream.text` by what the new tokens add, decoding a short window of tokens instead of the whole
    output each time. The window starts one update back, so a token's leading space is decoded the way a
    whole-sequence decode does; an incomplete multi-byte character waits for its next token (unless `final`)."""
    start, end = stream.decoded
    before = tokenizer.decode(stream.generated[start:end], skip_special_tokens=True)
    after = tokenizer.decode(stream.generated[start:], skip_special_tokens=True)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        stream.text += after[len(before):]
        stream.decoded = (end, len(stream.generated))


def send_text(stream: RequestStream) -> bool:
    """Emit the text the stream's tokens add (held back while it may be the start of a stop string); True when a
    stop string appeared (the text before it is sent, the rest never)."""
    decode_new(stream, stream.tokenizer)
    text = stream.text
    for stop in stream.params.stop:
        at = text.find(stop, max(len(stream.sent) - len(stop), 0)) if stop else -1
        if at >= 0:
            if at > len(stream.sent):
                stream.emit("text", text[len(stream.sent):at])
            stream.sent = text[:at]
            stream.stopped = True
            return True
    ready = len(text) - max((len(s) - 1 for s in stream.params.stop), default=0)
    if ready > len(stream.sent):
        stream.emit("text", text[len(stream.sent):ready])
        stream.sent = text[:ready]
    return False


def finish_stream(stream: RequestStream, reason: str) -> None:
    """Send the text held back (unless a stop string ended it) and end the stream."""
    if not stream.stopped:
        decode_new(stream, stream.tokenizer, final=True)
        if len(stream.text) > len(stream.sent):
            stream.emit("text", stream.text[len(stream.sent):])
            stream.sent = stream.text
    stream.finished = True
    stream.emit("done", reason)
