"""Copy checkpoint bytes into placed tensors: parallel reads into pinned buffers, asynchronous copies per device.

Each worker thread owns two pinned staging buffers. It reads a chunk of a file with `os.preadv` (which
drops the GIL, so reads from the page cache run in parallel), then queues host-to-device copies on its
own CUDA stream for that device and moves on to the other buffer; it only waits when it comes back to a
buffer whose copies are still in flight. CPU destinations are read straight into their memory.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import TensorEntry
from ..errors import CheckpointError

CHUNK_BYTES = 64 * 2**20


@dataclass
class CopyJob:
    """Fill `dst` (contiguous, any device, any float dtype) from a checkpoint entry."""

    entry: TensorEntry
    dst: torch.Tensor


@dataclass
class _Piece:
    job: CopyJob
    start: int  # absolute file offsets
    end: int
    first: int  # element range of the tensor
    last: int


@dataclass
class _Chunk:
    file: Path
    start: int
    end: int
    pieces: list[_Piece] = field(default_factory=list)


def _chunks(jobs: list[CopyJob], chunk_bytes: int) -> list[_Chunk]:
    """Split tensors into element-aligned pieces and group neighbours in one file into chunks of at most chunk_bytes."""
    pieces: list[_Piece] = []
    for job in jobs:
        e = job.entry
        item = max(1, e.nbytes // max(1, job.dst.numel()))
        step = max(item, chunk_bytes // item * item)
        for lo in range(e.start, e.end, step):
            hi = min(e.end, lo + step)
            pieces.append(_Piece(job, lo, hi, (lo - e.start) // item, (hi - e.start) // item))
    pieces.sort(key=lambda p: (str(p.job.entry.file), p.start))
    chunks: list[_Chunk] = []
    for piece in pieces:
        last = chunks[-1] if chunks else None
        if (last is not None and last.file == piece.job.entry.file and piece.start >= last.end
                and piece.end - last.start <= chunk_bytes and piece.start - last.end < 2**20):
            last.end = piece.end
            last.pieces.append(piece)
        else:
            chunks.append(_Chunk(piece.job.entry.file, piece.start, piece.end, [piece]))
    return chunks


def _read(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path} is truncated: could not read bytes {offset + done}..{offset + len(view)}")
        done += n


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class _Worker(threading.Thread):
    def __init__(self, work: "queue.Queue[_Chunk]", fds: dict[Path, int], chunk_bytes: int, pinned: bool,
                 report: Callable[[int, torch.device], None], stop: threading.Event,
                 after: dict[torch.device, torch.cuda.Event]) -> None:
        super().__init__(daemon=True)
        self.work, self.fds, self.chunk_bytes, self.pinned, self.after = work, fds, chunk_bytes, pinned, after
        self.report, self.stop = report, stop
        self.error: BaseException | None = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # handed to the caller, which re-raises it
            self.error = exc
            self.stop.set()

    def _loop(self) -> None:
        buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(2)]
        pending: list[list[torch.cuda.Event]] = [[], []]
        slot = 0
        while not self.stop.is_set():
            try:
                chunk = self.work.get_nowait()
            except queue.Empty:
                break
            fd = self.fds[chunk.file]
            if all(p.job.dst.device.type == "cpu" and p.job.dst.dtype == p.job.entry.dtype for p in chunk.pieces):
                for p in chunk.pieces:  # straight into the destination's memory, no staging
                    item = p.job.dst.element_size()
                    _read(fd, _bytes_of(p.job.dst)[p.first * item:p.last * item], p.start, chunk.file)
                    self.report(p.end - p.start, p.job.dst.device)
                continue
            for event in pending[slot]:
                event.synchronize()  # the copies out of this buffer have finished
            pending[slot] = []
            buffer = buffers[slot]
            _read(fd, _bytes_of(buffer)[: chunk.end - chunk.start], chunk.start, chunk.file)
            used: set[torch.device] = set()
            for p in chunk.pieces:
                src = buffer[p.start - chunk.start:p.end - chunk.start].view(p.job.entry.dtype)
                dst = p.job.dst.view(-1)[p.first:p.last]
                if dst.device.type == "cuda":
                    stream = self.streams.get(dst.device)
                    if stream is None:
                        stream = self.streams[dst.device] = torch.cuda.Stream(dst.device)
                        # the destination's memory may have been freed by kernels still queued on the caller's
                        # stream (the caching allocator only orders reuse on that stream): copy after them
                        stream.wait_event(self.after[dst.device])
                    with torch.cuda.stream(stream):
                        # same dtype: one DMA; otherwise copy, then convert on the GPU
                        dst.copy_(src if dst.dtype == src.dtype else src.to(dst.device, non_blocking=True),
                                  non_blocking=True)
                    used.add(dst.device)
                else:
                    dst.copy_(src)
                self.report(p.end - p.start, dst.device)
            for device in used:
                event = torch.cuda.Event()
                event.record(self.streams[device])
                pending[slot].append(event)
            slot = 1 - slot
        for stream in self.streams.values():
            stream.synchronize()


def copy_into(
    jobs: list[CopyJob],
    workers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    synchronize: bool = True,
) -> dict[str, float]:
    """Fill every job's tensor; return seconds until each device's last byte landed ("cuda:0": 1.2, ...).
    The copies have landed when this returns either way; `synchronize=False` skips the final device-wide
    synchronize (which also waits for other threads' kernels), and the times are then host times."""
    start = time.perf_counter()
    finished: dict[str, float] = {}
    lock = threading.Lock()
    for job in [j for j in jobs if j.entry.tensor is not None]:  # pickle checkpoints: already in memory
        job.dst.copy_(job.entry.tensor.reshape(job.dst.shape))
        finished[str(job.dst.device)] = time.perf_counter() - start
    jobs = [j for j in jobs if j.entry.tensor is None]
    if not jobs:
        return finished
    chunks = _chunks(jobs, chunk_bytes)
    work: "queue.Queue[_Chunk]" = queue.Queue()
    for chunk in chunks:
        work.put(chunk)
    pinned = torch.cuda.is_available() and any(j.dst.device.type == "cuda" for j in jobs)
    count = max(1, min(workers or min(16, os.cpu_count() or 1), len(chunks)))
    stop = threading.Event()

    def report(nbytes: int, device: torch.device) -> None:
        with lock:
            finished[str(device)] = time.perf_counter() - start
            if progress is not None:
                progress(nbytes)

    after = {}
    for device in {j.dst.device for j in jobs if j.dst.device.type == "cuda"}:
        after[device] = torch.cuda.Event()
        after[device].record(torch.cuda.current_stream(device))
    fds = {f: os.open(f, os.O_RDONLY) for f in {j.entry.file for j in jobs}}
    threads = [_Worker(work, fds, chunk_bytes, pinned, report, stop, after) for _ in range(count)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        for t in threads:
            t.join()
        for fd in fds.values():
            os.close(fd)
    errors = [t.error for t in threads if t.error is not None]
    if errors:
        raise errors[0]
    for device in {j.dst.device for j in jobs if j.dst.device.type == "cuda"} if synchronize else ():
        torch.cuda.synchronize(device)
        finished[str(device)] = time.perf_counter() - start
    return finished
