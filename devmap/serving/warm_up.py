"""Compiled steps for a service: whether a model gets them, and compiling them while it loads.

A service compiles a model's decode steps and its joins (`devmap.generation.compiled`, dynamic sizes: one compile for
every batch shape and pack width): the steps carrying joiners' prompts where they ride
(`devmap.generation.mixed_joins`), else the joins' prefill. It compiles them where that wins: every block on a GPU,
and weights that devmap's own products read (floating point, or int8, int4 and fp8 weights in layers whose projections
are joined: `devmap.kernels`; a layer left unjoined would run the library's product, which compiles to something
slower than eager). Other quantized weights (bitsandbytes') stay eager unless `--compile` asks: their compiled speed
is not measured. docs/serving.md and docs/quantization.md have what compiling gains and what it costs at a start.
`--no-compile` turns compiling off. The compile runs in a small continuous batch (its decode step, and its joins at
every pack width; once that has run whole with the region store in use, a later start runs the decode step and its
first join only, which load the stored entries: `warm_marks`), so that no request waits for it: at load, before the
model serves, or beside its serving (`step_compile`: the model answers with eager steps at once, and its batches move
to compiled steps once they are ready) where asked or where nothing of it is stored yet (`prepare.compiles_beside`),
never for a model split over
processes (`--tensor-parallel`: their warm-ups meet in collectives, which a second thread's calls would interleave
with). Inductor's on-disk cache makes a restart's compile faster, and the regions a service keeps
(`generation.region_store`) spare it dynamo's tracing too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..compat import compile_totals
from ..generation.continuous import SlotRequest, continuous_batch
from ..generation.graphed_step import captures_paused, timed_captures
from ..generation.joined_projections import every_layer_joined
from ..generation.region_store import region_totals
from ..planning.devices import is_gpu, parse_device_key
from ..planning.quantization import Quantization
from .interpreter_switch import switching_often
from .load_phases import CompiledGraphs
from .scheduler import CACHE_BUCKET, MIN_ROWS, BatchShape
from .warm_marks import ServedShapes, mark, served_shapes, warm_key, warmed

log = logging.getLogger("devmap.serving")

WARM_UP_STEPS = 4  # the first decode step compiles, the second captures, the rest replay
WARM_UP_PROMPT = 4  # tokens of each prompt of `warm_up`
EAGER_PROMPT = 128  # tokens of each prompt of `eager_first_steps`


def compiles(model: nn.Module, wanted: bool | None, quantization: Quantization | None) -> bool:
    """Whether the service compiles `model`'s decode steps: `wanted` (None: where it wins: unquantized weights, or
    quantized ones that devmap's products read, every layer joined), every block on a GPU. Other quantized weights
    compile only when asked (`--compile`)."""
    read_by_devmap = quantization is None or every_layer_joined(model)
    if wanted is False or (not read_by_devmap and not wanted):
        return False
    devices = set(getattr(model, "hf_device_map", {"": "cpu"}).values())
    return torch.cuda.is_available() and all(is_gpu(parse_device_key(d)) for d in devices)


def small_batch(max_rows: int, context: int) -> tuple[int, int]:
    """The rows and cache length of a warm-up's batch: the smallest batch a service starts (MIN_ROWS rows of
    CACHE_BUCKET tokens), within the model's rows and context (0: unbounded)."""
    return min(MIN_ROWS, max_rows), min(CACHE_BUCKET, context) if context else CACHE_BUCKET


def eager_first_steps(model: nn.Module, max_rows: int, context: int, riding: bool | None = None) -> None:
    """Run a small eager batch's first steps (a pack of prompts, then a decode step), uncaptured: the eager kernels a
    model serving before its compiled steps are ready runs (CUDA modules, cuBLAS's choices, devmap's Triton kernels)
    load here, before it answers, rather than in its first request's step, beside the compile."""
    rows, cache_len = small_batch(max_rows, context)
    prompt = [1] * min(EAGER_PROMPT, cache_len - 1)
    with continuous_batch(model, rows=rows, first_slot=len(prompt), cache_len=cache_len, riding=riding,
                          graphs=False, keep_graphs=False) as batch:
        batch.step([SlotRequest(prompt, 2, object()) for _ in range(rows)])
        batch.step([])
        batch.collect(everything=True)


class WarmUpTimes(NamedTuple):
    """Where a warm-up's seconds went: torch.compile (tracing, then inductor or its on-disk cache), capturing the steps
    as CUDA graphs, and the rest of running its steps; the graphs it compiled and how many came from the compile
    cache (all of them at a restart whose cache holds the model's steps); `served`: the shapes the model served at
    when it last ran, whose steps it made and kept for the first batch (None: it ran its small batch)."""

    compile: float
    capture: float
    warm_up: float
    graphs: CompiledGraphs
    served: ServedShapes | None = None

    def phases(self) -> dict[str, float]:
        """The load phases they are (`load_phases.PHASES`)."""
        return {"compile": self.compile, "capture": self.capture, "warm_up": self.warm_up}


def served_batch(model: nn.Module, max_rows: int, context: int, riding: bool | None,
                 lanes: int | None, key: str | None = None) -> tuple[str | None, bool, ServedShapes | None]:
    """Where a warm-up stands: the model's marker key (`warm_marks`; `key` where given), whether a warm-up ran whole
    before (its regions are in the store: a light warm-up), and the shapes it served at when it last ran (None: none
    recorded, or a model in lanes other than the service's batches': its batch would not be the served one)."""
    key = key or warm_key(model, max_rows, context, riding)
    light = warmed(key)
    served = served_shapes(key, context) if light and lanes is not None else None
    if served is not None and (served.batch.first_slot < WARM_UP_PROMPT
                               or served.batch.cache_len - served.batch.first_slot < WARM_UP_STEPS):
        served = None  # no room for the warm-up's requests: its small batch runs instead
    return key, light, served


def warm_up(model: nn.Module, max_rows: int, context: int, riding: bool | None = None, beside_serving: bool = False,
            stop: Callable[[], bool] = lambda: False, lanes: int | None = None, key: str | None = None,
            after_whole_pass: bool = False) -> WarmUpTimes:
    """Run a small continuous batch with compiled steps (compiling its decode step, and the steps carrying joiners'
    prompts or their joins' prefill, as `riding` chooses, at every pack width).

    Before the model serves: on GPUs its steps are captured too (a capture that would compile fails the warm-up) and
    kept on the model, so that a first batch of the warm-up's shape (a few short requests: MIN_ROWS rows of
    CACHE_BUCKET tokens) replays them instead of capturing them in the engine's loop, where the streams of every model
    the service holds would wait for those captures. Where a whole warm-up ran before and `lanes` says how the
    service's batches run, the batch is the one the model served at when it last ran, with the join shapes it met
    there (`warm_marks.ServedShapes`, returned as `WarmUpTimes.served`): a restarted service starts its batches at
    that shape, and its first one replays its decode step and its joins from its first step.

    `beside_serving`: while the model serves in another thread, its steps run uncaptured in a batch of its own, leaving
    the model's kept steps alone; no step of any thread captures meanwhile but while dynamo traces
    (`captures_paused(but_while_tracing=True)`: the serving thread's steps due to capture run eagerly until a trace
    lets them capture); `stop()` True ends it between two steps. Throughout, the interpreter passes between threads
    often (`interpreter_switch`), so batches serving beside it keep their pace.

    Its compile seconds and graphs are the process's (dynamo counts them for every thread alike): a load compiles
    one model at a time, and a compile beside serving is the only compile while it runs.

    `key`: the marker key the warm-up stands for (default: the model's own): a model cut down to a layer per device,
    compiling in a process of its own for the one that serves (`compile_process`), marks the served model's.
    `after_whole_pass`: that process's whole pass has just run, so what this light run compiles is what it left out,
    stored now (with a warning), and the marker stays: the next start loads it with the rest rather than compiling
    beside again."""
    prompt = [1] * WARM_UP_PROMPT
    paused = captures_paused(but_while_tracing=True) if beside_serving else contextlib.nullcontext()
    # light: a whole warm-up ran before, its regions are in the store: their entries load, no shape compiles
    key, light, served = served_batch(model, max_rows, context, riding, None if beside_serving else lanes, key)
    rows, cache_len = small_batch(max_rows, context)
    shape = BatchShape(rows, len(prompt), cache_len) if served is None else served.batch
    started, before, stored = time.perf_counter(), compile_totals(), region_totals()
    with switching_often(), timed_captures() as captures, paused, continuous_batch(
            model, rows=shape.rows, first_slot=shape.first_slot, cache_len=shape.cache_len,
            lanes=None if served is None else lanes, compile=True, riding=riding, graphs=not beside_serving,
            keep_graphs=not beside_serving, every_shape=not light,
            join_shapes=() if served is None else served.joins) as batch:
        # every row held: the batch's own decode step compiles; steps over its first rows reuse that compile
        batch.step([SlotRequest(prompt, WARM_UP_STEPS + 1, object()) for _ in range(shape.rows)])
        for _ in range(WARM_UP_STEPS):
            if stop() or not batch.step([]):
                break
        batch.collect(everything=True)
    after, elapsed, kept = compile_totals(), time.perf_counter() - started, region_totals()
    compiled_here = kept.compiled - stored.compiled
    if light and compiled_here and after_whole_pass:  # stored now: the next start loads them with the rest
        log.warning("the compile's process left %d compiled regions to this process (the log's 'compiled entry "
                    "made' lines name them)", compiled_here)
    elif light and compiled_here:
        mark(key, whole=False)  # the store had lost entries: the next start runs the whole pass again
    elif not light and not stop():  # not ended early: it ran whole
        mark(key, whole=True)
    # dynamo counts the store's compiles among its graphs, not among its seconds; entries loaded it never sees
    loaded = kept.loaded - stored.loaded
    compiling = (after.seconds - before.seconds + kept.compile_seconds - stored.compile_seconds
                 + kept.load_seconds - stored.load_seconds)
    return WarmUpTimes(compiling, captures.seconds, max(0.0, elapsed - compiling - captures.seconds),
                       CompiledGraphs(after.graphs - before.graphs + loaded,
                                      after.from_cache - before.from_cache + loaded), served)
