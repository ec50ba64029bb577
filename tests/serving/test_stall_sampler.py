"""Where the engine's loop thread sat in a slow step: the sampler names the longest run of samples in one place, and
a slow step's debug line carries it."""

import logging
import os
import threading
import time

import pytest

from devmap.serving.batch_trace import BatchTrace
from devmap.serving.stall_sampler import StallSampler


def _held_here(seconds: float) -> None:
    time.sleep(seconds)


def _brief(seconds: float) -> None:
    time.sleep(seconds)


def test_a_slow_steps_line_names_where_the_loop_thread_sat_longest(caplog):
    ready, done = threading.Event(), []

    def loop():
        ready.wait()
        began = time.perf_counter()
        _brief(0.05)
        _held_here(0.4)
        _brief(0.05)
        done.append((began, time.perf_counter()))

    worker = threading.Thread(target=loop)
    worker.start()
    sampler = StallSampler(worker.ident, interval=0.01)
    try:
        ready.set()
        worker.join()
        began, ended = done[0]
        seconds, where = sampler.longest(began, ended)
        assert "_held_here" in where and "loop" in where.split(" < ")[1]
        assert 0.3 < seconds <= ended - began
        assert sampler.longest(ended + 10, ended + 11) is None  # nothing sampled then
        trace = BatchTrace(began, 8, sampler)
        with caplog.at_level(logging.DEBUG, logger="devmap.serving"):
            trace.step(began, began + 0.001, 0, compiled=False)
        assert "longest in one place" in caplog.text and "_held_here" in caplog.text
    finally:
        sampler.close()
    assert not sampler._thread.is_alive()


def _busy_beside(until: float) -> None:
    while time.perf_counter() < until:
        sum(range(1000))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads' CPU time is read from Linux's /proc")
def test_a_slow_steps_line_names_the_thread_busiest_beside_it(caplog):
    began = time.perf_counter()
    busy = threading.Thread(target=_busy_beside, args=(began + 0.4,), name="a-busy-neighbour")
    idle_until = threading.Event()
    idle = threading.Thread(target=idle_until.wait, name="an-idle-neighbour")
    sampler = StallSampler(threading.get_ident(), interval=0.01)
    try:
        busy.start()
        idle.start()
        busy.join()
        ended = time.perf_counter()
        seconds, what = sampler.beside(began, ended)
        assert what.startswith("a-busy-neighbour at ") and "_busy_beside" in what
        assert 0.1 < seconds <= ended - began + 0.05  # its CPU time
        assert sampler.on_cpu(began, ended) < 0.1  # the sampled thread itself waited in join
        assert sampler.beside(ended + 10, ended + 11) is None
        with caplog.at_level(logging.DEBUG, logger="devmap.serving"):
            BatchTrace(began, 8, sampler).step(began, began + 0.001, 0, compiled=False)
        assert "ran most beside it" in caplog.text and "a-busy-neighbour" in caplog.text
        assert "the loop thread on a core" in caplog.text
        assert "an-idle-neighbour" not in caplog.text
    finally:
        idle_until.set()
        idle.join()
        sampler.close()
