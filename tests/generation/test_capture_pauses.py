"""Captures paused beside a compile: a thread that pauses them `but_while_tracing` lets other threads capture while
dynamo traces its compiled regions, and pauses them again while the backend compiles and while compiled code runs;
any other thread's compiles pause them in the backend only."""

import threading

import torch

from devmap.generation import compiled, graphed_step
from devmap.generation.graphed_step import captures_are_paused, captures_paused


def _recording_region(seen: list, monkeypatch):
    """A dynamic region whose tracing start, backend and runs record the pauses in force (aot_eager underneath)."""
    from torch._dynamo.callback import callback_handler

    def backend(graph, example_inputs):
        seen.append(("backend", graph_pauses()))
        inner = torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

        def run(*args):
            seen.append(("run", graph_pauses()))
            return inner(*args)

        return run

    name = f"devmap_test_recording_{id(seen)}"
    torch._dynamo.register_backend(backend, name=name)
    monkeypatch.setattr(compiled, "BACKEND", name)
    started = callback_handler.register_start_callback(lambda args: seen.append(("trace", graph_pauses())))

    def region(x):
        return torch.sin(x) * 2

    return compiled.compile_region(region, dynamic=True, sizes=lambda x: [(x, (0,))]), started


def graph_pauses() -> int:
    return graphed_step._paused


def test_a_compile_beside_serving_lifts_the_pause_while_tracing_only(compiled_on_cpu, monkeypatch):
    from torch._dynamo.callback import callback_handler

    # torch 2.11 without CUDA crashes a process whose first compile ran in a thread that has ended, at its next
    # compile (its fake tensors' no-op device guard): a compile in this thread first avoids it
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    seen = []
    region, started = _recording_region(seen, monkeypatch)
    try:
        def compiling():
            with captures_paused(but_while_tracing=True):
                seen.append(("before", graph_pauses()))
                region(torch.ones(3))
                region(torch.ones(5))  # the same compile: guards only, then a run
                seen.append(("after", graph_pauses()))

        thread = threading.Thread(target=compiling)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
    finally:
        callback_handler.remove_start_callback(started)
    assert seen == [("before", 1), ("trace", 0), ("backend", 1), ("run", 1), ("run", 1), ("after", 1)], seen
    assert graph_pauses() == 0 and not captures_are_paused()


def test_an_ordinary_compile_pauses_captures_in_its_backend_only(compiled_on_cpu, monkeypatch):
    from torch._dynamo.callback import callback_handler

    seen = []
    region, started = _recording_region(seen, monkeypatch)
    try:
        region(torch.ones(3))
        region(torch.ones(4))
    finally:
        callback_handler.remove_start_callback(started)
    assert seen == [("trace", 0), ("backend", 1), ("run", 0), ("run", 0)], seen


def test_while_a_compile_runs_beside_captures_count_as_paused_for_a_new_batchs_shapes():
    """A batch made meanwhile captures its join shapes at their second use, not all up front (a pause may come back
    at any moment), and a thread's pause is its own: another thread's block does not lift it."""
    inside, lifted = threading.Event(), threading.Event()

    def beside():
        with captures_paused(but_while_tracing=True):
            with graphed_step.tracing_lifted():
                inside.set()
                assert lifted.wait(30)

    thread = threading.Thread(target=beside)
    thread.start()
    assert inside.wait(30)
    assert graph_pauses() == 0 and captures_are_paused()
    with graphed_step.tracing_lifted():  # not this thread's pause: nothing lifted
        assert graph_pauses() == 0
    lifted.set()
    thread.join(30)
    assert graph_pauses() == 0 and not captures_are_paused()
