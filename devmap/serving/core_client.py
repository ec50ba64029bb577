"""How the API reaches the engine core: in a thread of its own process (`ThreadCore`, for Python callers and tests),
or in a process of its own (`ProcessCore`, what `devmap serve` runs), as vLLM splits its API server from its engine
core. The second keeps every request's Python work (HTTP, JSON, tokenizing, detokenizing, SSE writes) off the
interpreter that issues the GPUs' work: one interpreter runs one thread at a time, and a 1B model's decode step is
shorter than the API's work for a few dozen streaming clients.

Both take the same calls: `add` and `abort` requests, `call` one of the core's control methods (`core.CONTROL`),
`card` for what the API needs of a model (its context and tokenizer); the core's outputs come to `deliver`, once per
step, from a thread that is not the caller's event loop.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .compile_cache import keep_regions
from .core import CONTROL, EngineCore
from .core_parts import RegistrySettings, StartedCore
from .shard_start import StartedShards
from .errors import EngineGone, ServiceError
from .jobs import Job
from .limits import EngineLimits
from .outputs import Deliver
from .prepare import load_tokenizer
from .registry import ModelRegistry

log = logging.getLogger("devmap.serving")

GONE_SECONDS = 10.0  # how long a send that found the core's process gone waits to hear why it ended

Lost = Callable[[ServiceError], None]
"""Called once if the core can no longer answer (its process ended): every open request gets this error."""


@dataclass(frozen=True)
class ModelCard:
    """What the API side needs of a resident model: its id, directory, context (0: unbounded), vocabulary size (the
    token ids its embedding has rows for) and tokenizer."""

    id: str
    path: Path
    context: int
    vocab_size: int
    tokenizer: Any


class ThreadCore:
    """The engine core in a thread of this process, over `registry`."""

    def __init__(self, registry: ModelRegistry, limits: EngineLimits) -> None:
        self.registry = registry
        self._deliver: Deliver = lambda outputs: None
        self.core = EngineCore(registry, limits, lambda outputs: self._deliver(outputs))

    def attach(self, deliver: Deliver, lost: Lost) -> None:
        self._deliver = deliver

    def start(self) -> None:
        self.core.start()

    def close(self, timeout: float | None = None) -> None:
        self.core.close(timeout)

    def add(self, job: Job) -> None:
        self.core.add(job)

    def abort(self, request_id: int) -> None:
        self.core.abort(request_id)

    def call(self, method: str, *args: Any) -> Any:
        return _control(self.core, method, args)

    def card(self, model_id: str) -> ModelCard:
        resident = self.registry.get(model_id)
        return ModelCard(resident.id, resident.path, resident.context, resident.vocab_size, resident.tokenizer)

    def read_tokenizers(self, paths: Iterable[Path]) -> None:
        """Nothing to read ahead: a load in this process reads its model's tokenizer itself."""

    def forget(self, model_id: str) -> None:
        """The model was unloaded (the registry already says so)."""


class ProcessCore:
    """The engine core in a process of its own (`core_start.start_core`: it owns the GPUs; this process never touches
    CUDA), talking over two pipes: requests, aborts and control calls in; each step's outputs, control replies and
    idle unloads out."""

    def __init__(self, started: StartedCore) -> None:
        self._process, self._to_core, self._from_core = started.process, started.to_core, started.from_core
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._cards: dict[str, ModelCard] = {}
        self._read_ahead: dict[Path, Any] = {}  # tokenizers of models not loaded yet (`read_tokenizers`), by path
        self._deliver: Deliver = lambda outputs: None
        self._lost: Lost = lambda error: None
        self.gone: ServiceError | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="devmap-core-outputs", daemon=True)
        self._reader.start()
        atexit.register(self._stop_process)

    def attach(self, deliver: Deliver, lost: Lost) -> None:
        self._deliver, self._lost = deliver, lost

    def start(self) -> None:
        """The core's loop runs from its process's start."""

    def close(self, timeout: float | None = None) -> None:
        """The core finishes its queued and running requests, then its process ends."""
        self._closing = True
        if self.gone is None:
            try:
                self._send(("close",))
            except ServiceError:
                pass
        self._process.join(timeout)
        self._stop_process()

    def add(self, job: Job) -> None:
        self._send(("add", job.id, job.model_id, job.prompt_ids, job.params))

    def abort(self, request_id: int) -> None:
        try:
            self._send(("abort", request_id))
        except ServiceError:  # gone: nothing runs there any more
            pass

    def call(self, method: str, *args: Any) -> Any:
        """One of the core's control methods, run in its process (blocks until it answers)."""
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, method, args))
        except ServiceError:
            self._calls.pop(call_id, None)
            raise
        return future.result()

    def card(self, model_id: str) -> ModelCard:
        card = self._cards.get(model_id)
        if card is None:
            described = self.call("describe", model_id)
            path = Path(described["path"])
            tokenizer = self._read_ahead.pop(path, None)
            card = ModelCard(model_id, path, int(described["context_length"]), int(described["vocab_size"]),
                             tokenizer if tokenizer is not None else load_tokenizer(path))
            self._cards[model_id] = card
        return card

    def read_tokenizers(self, paths: Iterable[Path]) -> None:
        """Read the tokenizers of models the core is loading now (the service's command line): this process's first
        tokenizer read imports much of transformers, which then runs beside the core's loads, not after them. The
        card of a model loaded from one of these directories takes its tokenizer from here."""
        for path in paths:
            self._read_ahead[Path(path)] = load_tokenizer(Path(path))

    def forget(self, model_id: str) -> None:
        self._cards.pop(model_id, None)

    def _send(self, message: tuple) -> None:
        if self.gone is not None:
            raise self.gone
        try:
            with self._send_lock:
                self._to_core.send(message)
        except (OSError, EOFError):
            # the core's process ended: its last words (why it ended) may still be in the pipe the reader drains
            if threading.current_thread() is not self._reader:
                self._reader.join(GONE_SECONDS)
            raise self.gone or EngineGone("the engine core's process has ended; restart the service") from None

    def _read(self) -> None:
        """The core's messages, as they come: outputs to `deliver`, replies to their callers."""
        reason = None
        while True:
            try:
                message = self._from_core.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                self._deliver(message[1])
            elif kind == "reply":
                future = self._calls.pop(message[1], None)
                if future is not None:
                    if message[2]:
                        future.set_result(message[3])
                    else:
                        future.set_exception(message[3])
            elif kind == "unloaded":
                self.forget(message[1])
            elif kind == "failed":  # why the core's process is ending
                reason = message[1]
            elif kind == "closed":
                break
        self._process.join(5 if self._closing else 30)
        code = self._process.exitcode
        self.gone = EngineGone("the service is shutting down" if self._closing else reason if reason else
                               f"the engine core's process has ended (exit code {code}); restart the service")
        for future in list(self._calls.values()):
            future.set_exception(self.gone)
        self._calls.clear()
        if not self._closing:
            log.error("%s", self.gone.message)
        self._lost(self.gone)

    def _stop_process(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)


def _control(core: EngineCore, method: str, args: tuple) -> Any:
    if method not in CONTROL:
        raise ServiceError(f"the engine core has no call {method!r}")
    return getattr(core, method)(*args)


def import_model_stack() -> None:
    """What every load needs (transformers' modeling code, LLaMA's, accelerate), imported as the core's process
    starts, while the API's process imports its own (`core_start`): a load's plan phase then times planning, not
    imports. scipy and scikit-learn, which transformers imports wherever they are installed, are left out: nothing
    here uses them (`compat.hide_scipy_and_sklearn`)."""
    from ..compat import hide_scipy_and_sklearn

    hide_scipy_and_sklearn()
    import accelerate  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401  (the family most served; others import at load)


def run_core_process(settings: RegistrySettings, limits: EngineLimits, log_level: str, inbox: Connection,
                     outbox: Connection, spawned_at: float | None = None, shards: StartedShards | None = None,
                     models: Sequence[str] = ()) -> None:
    """The engine core's process: a registry of models, the core's loop in its thread, and this thread reading
    requests until the API asks it to close (or goes away); `shards`: a split's shard processes, started as this
    process started (`core_start`), else started here. `spawned_at` (time.time()): when the API side started
    it, for the seconds its start took (interpreter, imports: `import_model_stack`) in the log and `/metrics`.
    `models`: directories loaded from the start (`EngineCore.load_early`), before the API asks for them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the API side stops us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")  # uvicorn's look
    logging.getLogger("devmap").setLevel(log_level.upper())
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            outbox.send(message)

    import_model_stack()
    keep_regions()
    split = None
    if settings.tensor_parallel > 1:
        from .shard_start import start_shards
        from .shards import ShardProcesses, SplitBatches, SplitRegistry

        def failed(reason: str) -> None:  # a shard process ended: so do the models, and this process
            with contextlib.suppress(OSError, EOFError):
                send(("failed", reason))
            os._exit(1)

        split = ShardProcesses(shards or start_shards(settings, limits, log_level), failed)
        registry: ModelRegistry = SplitRegistry(
            split, settings.model_root, settings.device_map, settings.max_memory, settings.dtype,
            quantization=settings.quantization, limits=limits, random_weights=settings.random_weights)
        batches = SplitBatches(limits, split)
    else:
        registry = ModelRegistry(settings.model_root, settings.device_map, settings.max_memory, settings.dtype,
                                 quantization=settings.quantization, limits=limits,
                                 random_weights=settings.random_weights)
        batches = None
    core = EngineCore(registry, limits, lambda outputs: send(("out", outputs)),
                      unloaded=lambda model_id: send(("unloaded", model_id)), batches=batches)
    if spawned_at is not None:
        started = time.time() - spawned_at
        core.metrics.startup.labels(phase="core_process").set(started)
        log.info("engine core ready %.1f s after its process was spawned (interpreter and imports)", started)
    core.start()
    if models:
        core.load_early(models)

    def answer(call_id: int, method: str, args: tuple) -> None:
        try:
            result = (True, _control(core, method, args))
        except ServiceError as exc:
            result = (False, exc)
        except Exception as exc:  # noqa: BLE001 - the API answers it; the core goes on
            log.exception("control call %s failed", method)
            result = (False, ServiceError(f"{method} failed: {type(exc).__name__}: {exc}"))
        send(("reply", call_id, *result))

    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the API's process is gone: finish what runs, then end
            message = ("close",)
        kind = message[0]
        if kind == "add":
            core.add(Job(*message[1:]))
        elif kind == "abort":
            core.abort(message[1])
        elif kind == "call":
            threading.Thread(target=answer, args=message[1:], daemon=True).start()
        elif kind == "close":
            core.close()
            if split is not None:
                split.close()
            try:
                send(("closed",))
            except (OSError, EOFError):
                pass
            if split is not None:  # no destroy_process_group, nor its destructor at exit: after CUDA graphs
                logging.shutdown()  # captured NCCL collectives it can hang (pytorch#115388)
                os._exit(0)
            return
