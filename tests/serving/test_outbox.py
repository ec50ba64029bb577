"""Events leave the engine once per step: one wake-up per event loop for every request's tokens, and a client
that reads slower than tokens come gets them as one chunk."""

import asyncio

from devmap.serving import Engine, EngineLimits, GenerationParams
from devmap.serving.jobs import Job, Outbox


class RecordingLoop:
    def __init__(self) -> None:
        self.calls = []

    def call_soon_threadsafe(self, callback, *args) -> None:
        self.calls.append((callback, args))


def test_one_wake_up_per_loop_per_flush_in_order():
    a, b = RecordingLoop(), RecordingLoop()
    outbox = Outbox()
    jobs = [Job("m", [1], GenerationParams(), loop=loop, outbox=outbox) for loop in (a, a, b)]  # type: ignore[arg-type]
    for k, job in enumerate(jobs):
        job.emit("text", f"t{k}")
    jobs[0].emit("done", "stop")
    assert not a.calls and not b.calls  # nothing leaves before the flush
    outbox.flush()
    assert len(a.calls) == 1 and len(b.calls) == 1
    for loop in (a, b):
        callback, args = loop.calls[0]
        callback(*args)
    assert [jobs[0].events.get_nowait(), jobs[0].events.get_nowait()] == [("text", "t0"), ("done", "stop")]
    assert jobs[2].events.get_nowait() == ("text", "t2")
    outbox.flush()
    assert len(a.calls) == 1  # an empty flush wakes nobody


def test_a_slow_reader_gets_what_came_as_one_chunk():
    engine = Engine(None, EngineLimits())  # type: ignore[arg-type]  # reading a stream needs no model

    async def read() -> list:
        job = Job("tiny", [5], GenerationParams(), asyncio.get_running_loop())
        for piece in ("a", "b", "c"):
            job.events.put_nowait(("text", piece))
        job.events.put_nowait(("done", "length"))
        chunks = [c async for c in engine.stream(job)]
        return [chunks, job.finish_reason]

    assert asyncio.run(read()) == [["abc"], "length"]
