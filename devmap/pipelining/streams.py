"""Cross-stream hand-offs ordered by events, on streams that never make a copy wait for a stage's compute.

Stages are streams, not devices: each stage has its own set (compute, send, receive, capture), also when several
stages share one GPU (or the CPU), so a one-GPU run with `split_layers` exercises every hand-off of a multi-GPU run.

Ownership of what crosses streams (who writes, who reads, what makes reuse safe):

| tensor | written on | read on | reuse made safe by |
|---|---|---|---|
| a stage's output (eager, or a copy of a replayed graph's) | the stage's compute stream | the next stage's compute or receive stream | the reader waits for the writer's event; `record_stream(reader)` keeps the caching allocator from handing the memory to the writer's stream again before the reader is done (`hand_off`, `copy_into`, `copy_later`) |
| a replayed graph's output (`GraphedStep.static_out`) | its stage's compute stream (the replay) | the same stream only | it lives in its stage's graph pool, which the next replay of any graph of that pool may overwrite: no allocator bookkeeping protects it, so before it goes to another stream it is copied on its own stream (`GraphedStep.handed_on`) |
| a graph's fixed input (`GraphedStep.static_in`, positions, masks) | the reader's compute stream, or its receive stream after the writer's event | the replay, on the compute stream | the next write for the same (stage, lane) depends, through events, on the token of the step that read it, which needs that replay done |
| a fixed buffer, when made (zeros, or memory the allocator hands back) | the stream it is made on (the caller's, or a stage's inside `LaneStreams.making`) | side streams that hand-offs write it from | a new stream waits for its device's current stream (`StreamSet.get`), a call's start makes every stream wait for the caller's (`StreamSet.wait_for_caller`), and buffers made mid-call make the device's other streams wait (`StreamSet.settle`): the first hand-off into a buffer must not land before its zeros |
| graph pools | replays of one stage's graphs | the same stage's compute stream | one pool per stage (`StepCache.pool`): graphs sharing a pool never run at the same time |
| a joining pack's scratch cache (one per stage, every width's) | its stage's prefill | `take_prompts`, on the same stream | the packs use it one after another on that stream |
| a joiner's first token (`scatter_later`) | the last stage's compute stream | stage 0's receive stream, which writes it into the lane's fixed input after the lane's own tokens | the receive stream orders both writes; the lane's next step waits for the returned event |
| a stage's work on another GPU (the head on the first GPU, where embeddings are tied) | that stage's stream of that GPU (`LaneStreams.on`) | whoever waits for the stage's events | each event of the stage (`LaneStreams.record`) comes after it: the stage's stream waits for its stream on the other GPU first (on that GPU's default stream, nothing ordered it before the readers) |
| pinned host copies (`to_host`) | a copy on the producer's stream | the host, after the copy's event | the host waits for the event before reading; PyTorch's pinned allocator waits for the copy before reuse |

DEVMAP_STREAM_CHECK=1 (or a number of GPU clock cycles) checks this rule at run time on GPUs: every reader stream
sleeps before it reads a handed-over tensor (a writer that is not properly waited for gets ahead and overwrites it
first), a stage's stream on another GPU sleeps before the stage's work there (a reader that does not wait for it
reads what was there before), a replayed graph's output is poisoned (NaN) once it has been copied, and a graph's
fixed input is poisoned after each replay (a write ordered too early is lost), and a stage's stream sleeps before it
makes fixed buffers (a hand-off that does not wait for them is overwritten by their zeros). A violation then gives wrong
tokens instead of rare ones.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..compat import gpu_sleep

CHECK_VARIABLE = "DEVMAP_STREAM_CHECK"
CHECK_DEFAULT_CYCLES = 2_000_000  # about a millisecond: far longer than any hand-off of a decode step


def check_cycles() -> int:
    """The GPU cycles a reader stream sleeps before each hand-off under DEVMAP_STREAM_CHECK (0: checks off)."""
    value = os.environ.get(CHECK_VARIABLE, "").strip()
    if value in ("", "0"):
        return 0
    return CHECK_DEFAULT_CYCLES if value == "1" else int(value)


def poison(tensor: torch.Tensor) -> None:
    """Under DEVMAP_STREAM_CHECK, fill a buffer that must not be read again (until rewritten) with garbage, on the
    current stream: NaN for floats, -1 for integers (an index no embedding has)."""
    tensor.fill_(float("nan") if tensor.is_floating_point() else -1)


def check_delay(stream: Any) -> None:
    """Under DEVMAP_STREAM_CHECK, `stream` sleeps before its next work (a reader that does not wait for it gets
    ahead)."""
    cycles = check_cycles()
    if cycles and stream is not None:
        with torch.cuda.stream(stream):
            gpu_sleep(cycles)


CAPTURE_PRIORITY = -1
"""Captures draw their streams from torch's high-priority pool, which nothing else in devmap draws from (`new_stream`)."""


def new_stream(device: torch.device, kind: str = "compute") -> torch.cuda.Stream:
    """A stream from torch's pool for this purpose. torch hands its pool's 32 streams per device out round robin, so a
    stream is shared with whoever drew it before: for work that only orders it after unrelated work, but a stream
    another thread launches on while it captures fails that thread's launch ("operation not permitted when stream is
    capturing") or joins its work to the graph (a compile beside serving hit it). Capture streams come from the
    high-priority pool, drawn only for captures, which one thread makes at a time (the serving loop's)."""
    return torch.cuda.Stream(device, priority=CAPTURE_PRIORITY if kind == "capture" else 0)


class StreamSet:
    """Lazily created CUDA streams, keyed by (purpose, stage, device)."""

    def __init__(self) -> None:
        self._streams: dict[tuple, torch.cuda.Stream] = {}

    def get(self, kind: str, stage: int, device: torch.device) -> torch.cuda.Stream:
        """The stream of this purpose; a new one first waits for its device's current stream: a side stream's first
        write must not pass the zeros of a buffer made there before (or the last reads of memory it reuses)."""
        key = (kind, stage, device)
        if key not in self._streams:
            stream = self._streams[key] = new_stream(device, kind)
            stream.wait_stream(torch.cuda.current_stream(device))
        return self._streams[key]

    def settle(self, stream: torch.cuda.Stream) -> None:
        """Every other stream of the set on `stream`'s device waits for the work issued there so far: buffers just
        made on `stream` (zeros queued there) are then safe to write from any of them."""
        for other in self._streams.values():
            if other.device == stream.device and other != stream:
                other.wait_stream(stream)

    def wait_for_caller(self) -> None:
        """Every stream of the set waits for the caller's current stream of its device (inputs and buffers made
        there)."""
        for stream in self._streams.values():
            stream.wait_stream(torch.cuda.current_stream(stream.device))

    def join(self, outputs: list[torch.Tensor]) -> None:
        """The caller's current streams wait for all of this set's work; `outputs` become safe to use (and
        free) there."""
        for stream in self._streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        for tensor in outputs:
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))


def hand_off(x: torch.Tensor, event: Any, device: torch.device, stage: int, streams: StreamSet,
             compute: torch.cuda.Stream) -> torch.Tensor:
    """Make `x` (ready once `event` fires) usable on `compute`, a stream of `device`, copying it if needed.

    PyTorch copies across devices on the source's current stream after waiting for the destination's
    current stream; with a send stream (source) and a receive stream (destination) that do nothing else,
    the copy waits only for x itself, and neither stage's compute waits for the copy's neighbours.
    """
    if x.device == device:
        if event is not None:
            compute.wait_event(event)
        if x.is_cuda:
            x.record_stream(compute)
            check_delay(compute)
        return x
    recv = streams.get("recv", stage, device)
    if x.is_cuda:
        send = streams.get("send", stage, x.device)
        if event is not None:
            send.wait_event(event)
        check_delay(send)
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            y = x.to(device, non_blocking=True)
        x.record_stream(send)
    else:
        with torch.cuda.stream(recv):
            y = x.to(device, non_blocking=True)
    compute.wait_stream(recv)
    y.record_stream(compute)
    return y


def copy_into(dst: torch.Tensor, src: torch.Tensor, event: Any, stage: int, streams: StreamSet,
              compute: Any) -> None:
    """`dst.copy_(src)` once `event` fires, then `compute` (a stream of dst's device, or None on a CPU) waits
    for the copy. For fixed buffers: the caller guarantees nothing still reads `dst`."""
    if compute is None:
        dst.copy_(src)
        return
    if src.device == dst.device:
        if event is not None:
            compute.wait_event(event)
        check_delay(compute)
        with torch.cuda.stream(compute):
            dst.copy_(src, non_blocking=True)
        if src.is_cuda:  # src may come from another stream: its memory is not reused before this copy ran
            src.record_stream(compute)
        return
    compute.wait_stream(_copy_on_side_streams(dst, src, event, stage, streams))


def copy_later(dst: torch.Tensor, src: torch.Tensor, event: Any, stage: int, streams: StreamSet) -> Any:
    """`dst.copy_(src)` once `event` fires, on side streams only; returns an event for the reader to wait on just
    before it reads `dst` (None off GPUs, where the copy is done on return).

    Unlike `copy_into`, no compute stream waits now: a decode token going back to the first stage must not hold up
    the other lanes' work queued there before the lane's next step (it serialized the two GPUs)."""
    if not dst.is_cuda:
        dst.copy_(src)
        return None
    ready = torch.cuda.Event()
    ready.record(_copy_on_side_streams(dst, src, event, stage, streams))
    return ready


def scatter_later(dst: torch.Tensor, rows: list[int], src: torch.Tensor, event: Any, stage: int,
                  streams: StreamSet, after: Any = None) -> Any:
    """`dst[rows] = src` once `event` fires (and after `after`, an event of the same receive stream, e.g. an earlier
    `copy_later` into `dst`), on side streams only: the copy waits for src, never a compute stream for it. Returns
    an event for the reader to wait on before it reads `dst` (None off GPUs, where the write is done on return).

    A row's first token from a joining prefill goes to stage 0 so: stage 0's compute stream waiting for it would hold
    up the other lanes' work queued there (the joiners' lane waits for it anyway, right before its next step)."""
    if not dst.is_cuda:
        dst.index_copy_(0, torch.tensor(rows, dtype=torch.long), src.to(dst.device))
        return None
    recv = streams.get("recv", stage, dst.device)
    if after is not None:
        recv.wait_event(after)
    with torch.cuda.stream(recv):  # the buffers belong to the receive stream, which alone uses them
        moved = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
        index = torch.tensor(rows, dtype=torch.long, pin_memory=True).to(dst.device, non_blocking=True)
    _copy_on_side_streams(moved, src, event, stage, streams)
    with torch.cuda.stream(recv):
        dst.index_copy_(0, index, moved)
    ready = torch.cuda.Event()
    ready.record(recv)
    return ready


def _copy_on_side_streams(dst: torch.Tensor, src: torch.Tensor, event: Any, stage: int, streams: StreamSet) -> Any:
    """The copy on the stage's receive stream of dst's device (and the send stream of src's, across GPUs), after
    `event`; returns the receive stream."""
    recv = streams.get("recv", stage, dst.device)
    if src.is_cuda and src.device != dst.device:
        send = streams.get("send", stage, src.device)
        if event is not None:
            send.wait_event(event)
        check_delay(send)
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            dst.copy_(src, non_blocking=True)
        src.record_stream(send)
    else:
        if event is not None:
            recv.wait_event(event)
        check_delay(recv)
        with torch.cuda.stream(recv):
            dst.copy_(src, non_blocking=True)
        if src.is_cuda:
            src.record_stream(recv)
    return recv


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued on the current stream (into pinned memory, so the host does not wait for it)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=True)
    return host
