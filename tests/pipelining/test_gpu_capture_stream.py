"""Capture streams are never another thread's work streams: torch's stream pool hands its streams out round robin,
so a compile running beside the serving loop drew the stream the loop was capturing on and failed ("operation not
permitted when stream is capturing")."""

from __future__ import annotations

import threading

import torch

from devmap.pipelining.streams import StreamSet, new_stream
from devmap.testing import require_gpus

pytestmark = require_gpus(1)


def test_no_work_stream_is_a_capture_stream_however_many_are_drawn() -> None:
    device = torch.device("cuda", 0)
    captures = {new_stream(device, "capture").cuda_stream for _ in range(4)}
    captures.add(StreamSet().get("capture", 0, device).cuda_stream)
    work = {new_stream(device).cuda_stream for _ in range(100)}
    work |= {StreamSet().get(kind, 0, device).cuda_stream for kind in ("compute", "send", "receive") for _ in range(40)}
    assert not captures & work


def test_a_thread_launching_on_fresh_streams_does_not_break_a_capture() -> None:
    device = torch.device("cuda", 0)
    x = torch.ones(1024, device=device)
    stop, failures = threading.Event(), []

    def other_thread() -> None:  # draws and launches on fresh streams the whole time, as a compile beside serving does
        try:
            while not stop.is_set():
                with torch.cuda.stream(new_stream(device)):
                    (x * 2).sum().item()
        except Exception as exc:  # pragma: no cover - the failure this test guards against
            failures.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        for _ in range(50):
            graph, side = torch.cuda.CUDAGraph(), new_stream(device, "capture")
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                y = x + 1
                graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)
            graph.replay()
            assert torch.equal(y, x + 1)
    finally:
        stop.set()
        thread.join()
    assert not failures
