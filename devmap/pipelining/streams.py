"""Cross-device hand-offs ordered by events, on streams that never make a copy wait for a stage's compute."""

from __future__ import annotations

from typing import Any

import torch


class StreamSet:
    """Lazily created CUDA streams, keyed by (purpose, stage, device)."""

    def __init__(self) -> None:
        self._streams: dict[tuple, torch.cuda.Stream] = {}

    def get(self, kind: str, stage: int, device: torch.device) -> torch.cuda.Stream:
        key = (kind, stage, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

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
        return x
    recv = streams.get("recv", stage, device)
    if x.is_cuda:
        send = streams.get("send", stage, x.device)
        if event is not None:
            send.wait_event(event)
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
        with torch.cuda.stream(compute):
            dst.copy_(src, non_blocking=True)
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


def _copy_on_side_streams(dst: torch.Tensor, src: torch.Tensor, event: Any, stage: int, streams: StreamSet) -> Any:
    """The copy on the stage's receive stream of dst's device (and the send stream of src's, across GPUs), after
    `event`; returns the receive stream."""
    recv = streams.get("recv", stage, dst.device)
    if src.is_cuda and src.device != dst.device:
        send = streams.get("send", stage, src.device)
        if event is not None:
            send.wait_event(event)
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            dst.copy_(src, non_blocking=True)
        src.record_stream(send)
    else:
        if event is not None:
            recv.wait_event(event)
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
