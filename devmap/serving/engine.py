"""The serving engine as the API uses it: requests in, text out, over an engine core (`core.py`) that runs the
models in a thread of this process or in a process of its own (`core_client.py`).

Here live what is per request and not per token of the GPUs' work: the limits a request is checked against, the
queue's bound (429), tokenizing's counterpart (incremental detokenizing and stop strings, `text_stream.py`), the
request timeout and each request's asyncio stream. The core's outputs arrive once per step from another thread;
they are applied on each request's event loop, several steps at once when the loop is behind (a reader slower
than the tokens gets them as one chunk).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

from ..errors import UsageError
from .core_client import ModelCard, ProcessCore, ThreadCore
from .core_parts import RegistrySettings, StartedCore
from .core_start import start_core
from .errors import ModelUnloading, QueueFull, RequestTimeout, ServiceError, ShuttingDown
from .gc_pauses import watch_gc_pauses
from .jobs import Completion, GenerationParams, Job, TokenOutput
from .limits import EngineLimits
from .metrics import ApiMetrics
from .registry import ModelRegistry
from .text_stream import RequestStream, finish_stream, send_text


class HasContext(Protocol):
    context: int
    vocab_size: int


class Engine:
    """Resident models and the batching core behind an asyncio API. `start()` before use, `close()` to drain and
    stop. `Engine(registry)` runs the core in a thread of this process over `registry`; `Engine.spawned(...)` in a
    process of its own."""

    def __init__(self, registry: ModelRegistry | None, limits: EngineLimits | None = None,
                 core: ThreadCore | ProcessCore | None = None) -> None:
        if registry is None and core is None:
            raise UsageError("an Engine needs a ModelRegistry (its core runs in a thread) or a core: "
                             "Engine(registry) or Engine.spawned(RegistrySettings(...))")
        self.limits = limits or EngineLimits()
        if registry is not None:
            registry.limits = self.limits  # its loads make room for the batches these limits allow
        self.registry = registry  # None when the core runs in another process
        self.core = core if core is not None else ThreadCore(registry, self.limits)
        self.metrics = ApiMetrics()
        self._streams: dict[int, RequestStream] = {}  # open requests by id
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting = 0  # requests submitted that have no output yet (the queue's bound)
        self._inbox: dict[Any, list[tuple[RequestStream, TokenOutput]]] = {}  # per event loop, not yet applied
        self._closing = threading.Event()
        self._unloading: set[str] = set()  # models whose unload is under way: new requests for them get 503
        self._unwatch_gc: Callable[[], None] = lambda: None  # set while it serves
        self.core.attach(self._deliver, self._lost)

    @classmethod
    def spawned(cls, settings: RegistrySettings, limits: EngineLimits | None = None, log_level: str = "WARNING",
                started: StartedCore | None = None) -> Engine:
        """An engine whose core runs in a process of its own (what `devmap serve` runs): the one `started` with these
        settings and limits (`core_start.start_core`, which `devmap serve` calls before its heavy imports), or one
        started now."""
        limits = limits or EngineLimits()
        return cls(None, limits, ProcessCore(started or start_core(settings, limits, log_level)))

    def start(self) -> None:
        self._unwatch_gc = watch_gc_pauses(observe=self.metrics.gc_pauses.observe)
        self.core.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued and running ones, stop the core."""
        self._closing.set()
        self.core.close(timeout)
        self._unwatch_gc()
        self._unwatch_gc = lambda: None

    # -- models -------------------------------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        return self.core.call("models")

    def describe(self, model_id: str) -> dict[str, Any]:
        return self.core.call("describe", model_id)

    def load(self, name: str, model_id: str | None = None, device_map: Any = None, max_memory: Any = None,
             dtype: str | None = None, under_root: bool = True) -> dict[str, Any]:
        """Load a model in the core (blocks: run it off the event loop); its description, plan and load report."""
        described = self.core.call("load", name, model_id, device_map, max_memory, dtype, under_root)
        self.card(described["id"])  # its tokenizer ready before its first request
        return described

    def read_tokenizers(self, paths: Iterable[Path]) -> None:
        """Read the tokenizers of these model directories now, while the core loads their models (`devmap serve`'s
        command line: `start_core(models=...)`), so that their `load` does not wait for it after the core's."""
        self.core.read_tokenizers(paths)

    def record_startup(self, phase: str, seconds: float) -> None:
        """One phase of the service's start, into the core's `devmap_startup_seconds`."""
        self.core.call("record_startup", phase, seconds)

    def unload(self, model_id: str) -> None:
        """Unload a model (blocks: run it off the event loop): new requests for it get 503 at once, those it took
        finish within the limits' `unload_drain` (the rest end with an error), then it is freed."""
        with self._lock:
            self._unloading.add(model_id)
        try:
            self.core.call("unload", model_id)
        finally:
            with self._lock:
                self._unloading.discard(model_id)
            self.core.forget(model_id)

    def card(self, model_id: str) -> ModelCard:
        return self.core.card(model_id)

    def render_metrics(self) -> bytes:
        """The API's metrics and the core's (blocks: run it off the event loop)."""
        return self.metrics.render() + self.core.call("render_metrics")

    def start_profile(self) -> dict[str, Any]:
        """Start recording the engine core's steps (blocks until it records: run it off the event loop)."""
        return self.core.call("start_profile")

    def stop_profile(self) -> dict[str, Any]:
        """Stop recording; the files written (blocks: run it off the event loop)."""
        return self.core.call("stop_profile")

    # -- requests -----------------------------------------------------------------------------------------------

    def check(self, model: HasContext, prompt_ids: list[int], params: GenerationParams) -> None:
        """Refuse what the limits or the model do not allow (a 400 naming the field)."""
        self.limits.check_request(prompt_ids, params, model.context, model.vocab_size)

    def submit(self, model_id: str, prompt_ids: list[int], params: GenerationParams) -> RequestStream:
        """Queue a request (from a coroutine: its events arrive on the running loop)."""
        if self._closing.is_set():
            raise ShuttingDown("the service is shutting down")
        if model_id in self._unloading:
            raise ModelUnloading(f"model {model_id!r} is being unloaded and takes no new requests", param="model")
        # cached per model (a load fills it): only an id the API has not seen asks the core, once, from this loop
        card = self.card(model_id)
        self.check(card, prompt_ids, params)
        with self._lock:
            if self._waiting >= self.limits.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting, the most this service queues; retry later")
            self._waiting += 1
            stream = RequestStream(next(self._ids), model_id, list(prompt_ids), params, card.tokenizer,
                                   asyncio.get_running_loop())
            self._streams[stream.id] = stream
        self.metrics.queue_depth.inc()
        self.metrics.prompt_tokens.labels(model=model_id).inc(len(prompt_ids))
        try:
            self.core.add(Job(stream.id, model_id, stream.prompt_ids, params))
        except ServiceError:
            self._close_stream(stream)
            raise
        return stream

    async def stream(self, job: RequestStream) -> AsyncIterator[str]:
        """The request's text as it is generated; ends when the request finishes (see `job.finish_reason`)."""
        deadline = job.arrived + self.limits.request_timeout
        held: tuple | None = None  # an event read while gathering text, handled next
        try:
            while True:
                if held is not None:
                    event, held = held, None
                else:
                    left = deadline - time.perf_counter()
                    try:
                        event = await asyncio.wait_for(job.events.get(), timeout=max(left, 0.0))
                    except asyncio.TimeoutError:
                        raise RequestTimeout(f"the request ran past the service's timeout of "
                                             f"{self.limits.request_timeout:g} s") from None
                if event[0] == "text":
                    text = event[1]
                    while not job.events.empty():  # what came while the client was slower goes as one chunk
                        more = job.events.get_nowait()
                        if more[0] != "text":
                            held = more
                            break
                        text += more[1]
                    yield text
                elif event[0] == "done":
                    job.finish_reason = event[1]
                    return
                else:
                    raise event[1]
        finally:
            if not job.finished:  # a client that went away (or timed out) frees its row of the batch
                job.finished = True
                self._close_stream(job)
                self.core.abort(job.id)

    async def complete(self, model_id: str, prompt_ids: list[int], params: GenerationParams) -> Completion:
        job = self.submit(model_id, prompt_ids, params)
        text = "".join([piece async for piece in self.stream(job)])
        return Completion(text, job.finish_reason or "stop", len(prompt_ids), len(job.generated))

    # -- the core's outputs -------------------------------------------------------------------------------------

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        """A step's outputs (from the core's thread, or the thread reading its process): to each request's event
        loop, one wake-up per loop however many steps it has to catch up on."""
        wake = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                pending = self._inbox.get(stream.loop)
                if pending is None:
                    pending = self._inbox[stream.loop] = []
                    wake.append(stream.loop)
                pending.append((stream, out))
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._apply, loop)
            except RuntimeError:  # the loop has closed: its clients are gone
                with self._lock:
                    self._inbox.pop(loop, None)

    def _apply(self, loop: Any) -> None:
        """On `loop`: its requests' outputs so far, merged per request, turned into text events."""
        with self._lock:
            pending = self._inbox.pop(loop, [])
        merged: dict[int, tuple[RequestStream, TokenOutput]] = {}
        for stream, out in pending:
            if stream.id in merged:
                merged[stream.id][1].merge(out)
            else:
                merged[stream.id] = (stream, out)
        for stream, out in merged.values():
            if stream.finished:
                continue
            if not stream.heard:
                stream.heard = True
                with self._lock:
                    self._waiting -= 1
                self.metrics.queue_depth.dec()
            if out.error is not None:
                stream.emit("error", out.error)
                stream.finished = True
                self._close_stream(stream)
                continue
            stream.scores.extend(out.scores)
            if out.prompt_scores is not None:
                stream.prompt_scores = out.prompt_scores
            if out.tokens:
                if not stream.generated:
                    self.metrics.first_token.observe(time.perf_counter() - stream.arrived)
                stream.generated.extend(out.tokens)
                if send_text(stream):  # a stop string: the text ends here, the core stops generating it
                    self._finish(stream, "stop")
                    self.core.abort(stream.id)
                    continue
            if out.finish_reason is not None:
                self._finish(stream, out.finish_reason)

    def _finish(self, stream: RequestStream, reason: str) -> None:
        finish_stream(stream, reason)
        self.metrics.completion_tokens.labels(model=stream.model_id).inc(len(stream.generated))
        self._close_stream(stream)

    def _close_stream(self, stream: RequestStream) -> None:
        """The request leaves the open ones (and the queue's count, if it was still waiting)."""
        with self._lock:
            if self._streams.pop(stream.id, None) is None:
                return
            if not stream.heard:
                stream.heard = True
                self._waiting -= 1
                self.metrics.queue_depth.dec()

    def _lost(self, error: ServiceError) -> None:
        """The core can no longer answer: every open request ends with `error`."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(self._fail, stream, error)
            except RuntimeError:
                pass

    def _fail(self, stream: RequestStream, error: ServiceError) -> None:
        if not stream.finished:
            stream.emit("error", error)
            stream.finished = True
            self._close_stream(stream)
