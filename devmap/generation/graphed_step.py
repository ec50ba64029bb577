"""One stage's work on one lane (a decode step, or a prompt's prefill): eager once, then a replayed CUDA graph.

A stage of a LLaMA-style model is hundreds of kernels issued from transformers' Python; one thread issuing
every stage's work spends longer launching them than the GPUs take to run them, at decode sizes and even
for a 1B model's prefill. Replaying a captured graph issues them as one launch. A step reads fixed
buffers only (a decode step also advances its cache slot itself), so the same graph serves every token
or every call. Where capture fails (an operation that syncs with the host, say) the step stays eager. Each capture
gets a cuBLAS workspace of its own (`compat.own_blas_workspace`): the one its capture stream had would be shared with
that stream's next, eager, user.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

from ..compat import begin_capture, fail_on_recompile, own_blas_workspace
from ..pipelining.streams import check_cycles, new_stream, poison

log = logging.getLogger("devmap.generation")

_CAPTURING = threading.RLock()  # held by a capture, and to change `_paused` or `_beside`
_paused = 0  # pauses in force now, in any thread: `captures_paused` blocks open, less those lifted for tracing
_beside = 0  # `captures_paused(but_while_tracing=True)` blocks open, in any thread


class _ThreadPauses(threading.local):
    """This thread's share of the pauses: its `but_while_tracing` blocks open, and whether a compiled call of this
    thread has lifted its pause (`tracing_lifted`)."""

    beside = 0
    lifted = False


_thread = _ThreadPauses()


@contextlib.contextmanager
def captures_paused(but_while_tracing: bool = False) -> Iterator[None]:
    """While inside (any thread), no step captures: a step due to capture runs eagerly and captures at a later use.
    Entering waits for a capture in flight to end. For GPU work of another thread that must not overlap a capture: a
    compile beside serving (its device synchronizations and kernel loads fail with "operation not permitted when
    stream is capturing" while any stream of the device captures, whichever thread's).

    `but_while_tracing`: except while this thread traces a compiled region (`tracing_lifted`: dynamo's guards and
    tracing, on fake tensors, reach no device), so that steps of other threads capture meanwhile; the backend's
    compile and the compiled graphs' runs pause them again (`device_work_paused`)."""
    global _paused, _beside
    with _CAPTURING:
        _paused += 1
        _beside += but_while_tracing
    _thread.beside += but_while_tracing
    try:
        yield
    finally:
        _thread.beside -= but_while_tracing
        with _CAPTURING:
            _paused -= 1
            _beside -= but_while_tracing


_UNCHANGED = contextlib.nullcontext()  # what the two below give where they change nothing: no generator per call


def tracing_lifted() -> contextlib.AbstractContextManager[None]:
    """Around a call of a compiled region: in a thread whose captures are paused `but_while_tracing`, the pause is
    lifted for the call (its guards, and its tracing where it compiles: host work only); elsewhere nothing changes.
    Whatever reaches a device inside pauses again (`device_work_paused`)."""
    return _UNCHANGED if not _thread.beside or _thread.lifted else _lifted()


@contextlib.contextmanager
def _lifted() -> Iterator[None]:
    global _paused
    with _CAPTURING:
        _paused -= 1
    _thread.lifted = True
    try:
        yield
    finally:
        _thread.lifted = False
        with _CAPTURING:  # waits for a capture in flight to end
            _paused += 1


def device_work_paused() -> contextlib.AbstractContextManager[None]:
    """Around device work inside a compiled call (its backend's compile: kernel loads, autotuning; a compiled graph's
    run): captures paused again where `tracing_lifted` lifted them; elsewhere nothing changes."""
    return captures_paused() if _thread.lifted else _UNCHANGED


class CaptureClock:
    """Seconds the steps of one thread spent capturing inside a `timed_captures` block (a load's capture phase)."""

    def __init__(self) -> None:
        self.seconds = 0.0


_clock: ContextVar[CaptureClock | None] = ContextVar("devmap_capture_clock", default=None)


@contextlib.contextmanager
def timed_captures() -> Iterator[CaptureClock]:
    """Inside, the captures of this thread's steps add their seconds to the clock it gives (other threads' don't)."""
    clock = CaptureClock()
    token = _clock.set(clock)
    try:
        yield clock
    finally:
        _clock.reset(token)


def captures_are_paused() -> bool:
    """Whether captures are paused now, in any thread (a step due to capture would run eagerly), or may pause at any
    moment (a `but_while_tracing` block is open: a compile beside serving)."""
    return _paused > 0 or _beside > 0


class GraphedStep:
    """`step()` runs the work of one (stage, lane) on the current stream and returns its output tensor.

    `static_in` is the buffer the step reads (token ids on stage 0, else the hidden state); fill it before
    each call. With `graph=True` the first call runs eagerly (it also warms up kernels and allocations),
    the second captures the step into `pool` and replays it, later calls only replay; a graph's output is
    the same tensor each time, valid until the next replay of any graph of its pool (`handed_on`). A `compiled`
    body (torch.compile regions) is captured with dynamo refusing to compile: a capture cannot hold a compile. An
    eager one leaves dynamo alone (its stance is the process's: another thread may be compiling meanwhile).
    """

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], static_in: torch.Tensor, graph: bool,
                 pool: Any = None, capture_stream: torch.cuda.Stream | None = None, compiled: bool = False) -> None:
        self.body, self.static_in, self.compiled = body, static_in, compiled
        self.use_graph = graph and static_in.is_cuda
        self.pool, self.capture_stream = pool, capture_stream
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_out: torch.Tensor | None = None
        self.capture_error: BaseException | None = None
        self.checked = static_in.is_cuda and check_cycles() > 0  # DEVMAP_STREAM_CHECK (pipelining.streams)

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.graph is None and self.use_graph and self.calls > 1:
            with _CAPTURING:
                if not _paused:  # else eager now, captured at a later use
                    started = time.perf_counter()
                    self._capture()
                    clock = _clock.get()
                    if clock is not None:
                        clock.seconds += time.perf_counter() - started
        if self.graph is not None:
            self.graph.replay()
            out = self.static_out
            assert out is not None
        else:
            out = self.body(self.static_in)
        if self.checked:  # the input must be written again before the next call reads it
            poison(self.static_in)
        return out

    def handed_on(self, out: torch.Tensor, crosses: bool) -> torch.Tensor:
        """This step's output `out`, made safe to go on to another stage (`crosses`): a replayed graph's output is
        copied first, on this stage's stream. The graphs of a stage share one memory pool, so that output may be
        another graph's scratch space: the stage's next replay (another lane's step, with more lanes than stages)
        can overwrite it while the next stage's stream still reads it (the last of 3 lanes over 2 stages got other
        greedy tokens so; `tests/generation/test_gpu_streams.py` makes it fail on one GPU without this copy)."""
        if not crosses or self.graph is None:
            return out
        copy = out.clone()
        if self.checked:
            poison(out)
        return copy

    def _capture(self) -> bool:
        """Capture the step (nothing runs while capturing); False, and eager from now on, where it can't be."""
        current = torch.cuda.current_stream(self.static_in.device)
        side = self.capture_stream or new_stream(self.static_in.device, "capture")
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # no cyclic garbage collection while capturing: it may free an earlier call's graphs, whose pools are then
        # released with cudaFree, which invalidates the capture (and a failed capture leaves its pool unusable).
        # torch.cuda.graph() collects before every capture instead, which costs far more.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side), fail_on_recompile() if self.compiled else contextlib.nullcontext(), \
                    own_blas_workspace():
                begin_capture(graph, self.pool)
                try:
                    out = self.body(self.static_in)
                except Exception as exc:  # not capturable: end the capture, stay eager
                    self.capture_error = exc
                    out = None
                finally:
                    try:
                        graph.capture_end()
                    except Exception as exc:  # an invalidated capture fails here
                        self.capture_error = self.capture_error or exc
                        out = None
        except Exception as exc:  # the pool is unusable (an earlier capture into it failed): stay eager
            self.capture_error = exc
            out = None
        finally:
            if collecting:
                gc.enable()
        current.wait_stream(side)
        if out is None:
            self.use_graph = False
            reason = str(self.capture_error).splitlines()[0] if self.capture_error else "no output"
            log.warning("a step stays eager (uncaptured, slower): its capture failed: %s: %s",
                        type(self.capture_error).__name__, reason)
            return False
        self.graph, self.static_out = graph, out
        return True
