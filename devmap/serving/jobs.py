"""What a request is on its way through the engine: its generation parameters, its state, its finished form."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .kv_budget import KVBudget


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks for: at most `max_new_tokens` tokens (its token budget; HTTP's `max_tokens`), temperature 0
    is greedy decoding (transformers' tokens)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def batch_key(self) -> tuple:
        """Requests batch together when they decode the same way (one sampling setting per generate call)."""
        if self.temperature == 0:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class Completion:
    """A finished request: its text, why it ended ("stop" or "length") and the token counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Job:
    """One request on its way through the engine; events go to `events` on the request's event loop."""

    model_id: str
    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    waiting_since: float = field(default_factory=time.perf_counter)  # arrival, or when its batch stopped under it
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (up to the last complete character)
    sent: str = ""  # emitted so far (a prefix of text)
    decoded: tuple[int, int] = (0, 0)  # token offsets: start of the decode window, end of what text covers
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    stopped: bool = False  # a stop string ended it
    resumed: bool = False  # a batch stopped before it ended, and it waits to continue (counted out of the queue)
    kv_budget: KVBudget | None = None  # the KV cache its model's memory plan made room for (None: unbounded)

    @property
    def budget_left(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_new_tokens - len(self.generated)

    outbox: "Outbox | None" = None  # the engine's: events leave in one wake-up of the event loop per step

    def emit(self, *event: Any) -> None:
        """An event for the request's stream: ("text", str), ("done", finish reason) or ("error", exception)."""
        if self.outbox is not None:
            self.outbox.put(self, event)
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Outbox:
    """Events of many requests, handed to their event loops together: one thread-safe wake-up per loop per
    `flush` (the engine flushes after each step's tokens) instead of one per token."""

    def __init__(self) -> None:
        self._items: list[tuple[Job, tuple]] = []
        self._lock = threading.Lock()

    def put(self, job: Job, event: tuple) -> None:
        with self._lock:
            self._items.append((job, event))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        by_loop: dict[Any, list[tuple[asyncio.Queue, tuple]]] = {}
        for job, event in items:
            by_loop.setdefault(job.loop, []).append((job.events, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, events)
            except RuntimeError:  # the loop has closed: its clients are gone
                pass


def _put_all(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)
