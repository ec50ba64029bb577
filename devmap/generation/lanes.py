"""Lanes: the micro-batches of a pipelined LLaMA call, each with a static KV cache on every stage, and what the
prefill and decode halves of the lane runner share: the stage streams (`LaneStreams`), events, hand-offs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .busy import BusyClock
from .causal_lm import CausalLMStages
from ..errors import UsageError
from .graphed_step import GraphedStep
from .lane_cache import DecodeInputs, LaneCache
from ..pipelining.streams import StreamSet, check_delay, hand_off

EOS_CHECK_LAG = 2  # steps between a lane's last token and the host reading whether its rows all ended


@dataclass
class Lane:
    rows: slice
    ids: torch.Tensor  # the prompt, on the embedding device once placed (`place_lanes`)
    mask: torch.Tensor  # its attention mask, likewise
    padded: bool
    caches: list[LaneCache] = field(default_factory=list)  # per stage
    steps: list[GraphedStep] = field(default_factory=list)  # decode step per stage
    row_steps: dict[Any, list[Any]] = field(default_factory=dict)  # decode steps over the first rows only, per row
    # count (continuous batches whose held rows are fewer: `lane_decode.computed_rows`), and per ("mixed", rows, pack
    # width) the steps that carry a pack of prompts (`LaneDecode.mixed_steps`)
    inputs: list[DecodeInputs] = field(default_factory=list)  # decode-step inputs per stage
    tokens: list[torch.Tensor] = field(default_factory=list)
    unfinished: list[torch.Tensor] = field(default_factory=list)  # after each token: rows still generating
    ended: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # (event, host flag "all rows ended")
    done: bool = False
    prompt: dict[str, Any] = field(default_factory=dict)  # mask, position ids (stage 0's device), ready event
    token_ready: Any = None  # event: the lane's last token is in stage 0's input buffer
    undelivered: list[tuple[int, Any, torch.Tensor]] = field(default_factory=list)  # (step, event, host tokens)


OnTokens = Callable[[slice, int, torch.Tensor], bool]
"""Called with (the lane's rows of the batch, the step, those rows' tokens on the CPU); False stops generation."""



class LaneStreams:
    """The stages of one generate() or forward() call and their streams: every lane-step is issued from one
    thread, each stage on its own stream."""

    def __init__(self, stages: CausalLMStages, lanes: list[Lane], graphs: bool, compile: bool = False,
                 dynamic: bool = False) -> None:
        self.s, self.lanes = stages, lanes
        self.streams = StreamSet()
        self.graphs = graphs and graphs_possible(stages.devices)
        self.compile = compile  # decode steps and prefills through torch.compile
        # compiled with symbolic sizes (devmap.generation.compiled): a decode step's rows and cache columns, a
        # prefill's prompt width
        self.dynamic = dynamic
        self.clock = BusyClock(len(stages.stages))  # how busy each stage is (timed where a caller samples steps)
        # per stage stream (by id): its stage's streams on the other devices its work runs on (`on`)
        self._spills: dict[int, list[Any]] = {}

    @property
    def runs_before_serving(self) -> int:
        """How often a batch runs each of its step shapes before its first step: eager, then captured (once without
        graphs: a compile beside serving, whose batch compiles the shapes and loads their kernels)."""
        return 2 if self.graphs else 1

    def capture_stream(self, j: int) -> Any:
        device = self.s.stages[j].device
        return self.streams.get("capture", j, device) if device.type == "cuda" else None

    def layout(self) -> tuple:
        """What identifies the stages and their steps for cached steps: compiled steps are never reused for eager
        ones, nor eager for compiled."""
        stages = tuple((str(st.device), id(st.layers[0]), len(st.layers)) for st in self.s.stages)
        return stages, self.compile

    def start(self) -> None:
        """Every stream of the call (each stage's compute streams, on its own device and the others its work runs on,
        and any side stream made before) waits for the caller's work so far (inputs, fresh buffers)."""
        for j, stage in enumerate(self.s.stages):
            if stage.device.type == "cuda":
                self._spill_streams(j, "compute", self.streams.get("compute", j, stage.device))
        self.streams.wait_for_caller()

    @contextlib.contextmanager
    def making(self, j: int) -> Iterator[None]:
        """Fixed buffers of stage j made inside, on its device's current stream (stage j's, inside `on(j)`): the call's
        other streams of that device, from which hand-offs write them, wait for them after. Under DEVMAP_STREAM_CHECK
        that stream sleeps first, so a writer that does not wait has its write overwritten by the buffer's zeros."""
        device = self.s.stages[j].device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        check_delay(stream)
        yield
        if stream is not None:
            self.streams.settle(stream)

    @contextlib.contextmanager
    def on(self, j: int, kind: str = "compute") -> Iterator[Any]:
        """Stage j's device and its stream of this kind (None on a CPU). Work the stage issues on another device (the
        head on the first GPU where embeddings are tied, `CausalLMStages.other_devices`) goes to the stage's stream of
        that device, which `record` folds into the stage's events: on that device's current stream (the thread's
        default one) nothing would order it before the readers of the stage's events."""
        device = self.s.stages[j].device
        if device.type != "cuda":
            yield None
            return
        stream = self.streams.get(kind, j, device)
        spills = self._spill_streams(j, kind, stream)
        if not spills:  # nearly every call: all the stage's work on its own device
            with torch.cuda.device(device), torch.cuda.stream(stream):
                yield stream
            return
        with contextlib.ExitStack() as scope:
            for other in spills:  # first: entering a stream's context sets its device
                check_delay(other)  # under DEVMAP_STREAM_CHECK, a reader that does not wait for it reads stale data
                scope.enter_context(torch.cuda.stream(other))
            scope.enter_context(torch.cuda.device(device))
            scope.enter_context(torch.cuda.stream(stream))
            yield stream

    def record(self, stream: Any) -> Any:
        """An event on `stream`, a stage's stream from `on` (None on a CPU), that fires once everything the stage
        issued there so far ran, its work on other devices included."""
        if stream is None:
            return None
        for other in self._spills.get(id(stream), ()):
            stream.wait_stream(other)
        return record_event(stream)

    def _spill_streams(self, j: int, kind: str, stream: Any) -> list[Any]:
        """Stage j's streams of this kind on the other GPUs its work runs on (each waits, when made, for the caller's
        work on its device so far: `StreamSet.get`)."""
        spills = self._spills.get(id(stream))
        if spills is None:
            spills = self._spills[id(stream)] = []
            for device in self.s.other_devices(j):
                if device.type == "cuda":
                    spills.append(self.streams.get(kind, j, device))  # a new stream waits for the caller's work
        return spills

    def compiled_body(self, body: Any) -> Any:
        """`body`, a stage step, with its regions compiled (`CausalLMStages.compile_regions`) when compiling."""
        if self.compile:
            self.s.compile_regions(self.dynamic)
        return body


def graphs_possible(devices: list[torch.device]) -> bool:
    """CUDA graphs need every stage on a GPU (tests make this True on a CPU to run the cached-step paths,
    whose steps then stay eager)."""
    return all(d.type == "cuda" for d in devices)


def record_event(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def move_to_stage(value: Any, event: Any, device: torch.device, j: int, streams: StreamSet, compute: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return hand_off(value, event, device, j, streams, compute) if compute is not None else value.to(device)
    if isinstance(value, tuple):
        return tuple(move_to_stage(v, event, device, j, streams, compute) for v in value)
    return value


def split_lanes(stages: CausalLMStages, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                lanes: int | None, default: int) -> list[Lane]:
    """The batch's rows in `lanes` (else `default`) lanes of equal size but the last, their prompts where the
    caller's are: `place_lanes` moves them to the embedding device once every check that may refuse the call ran."""
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise UsageError(f"input_ids must be a non-empty (batch, length) tensor, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    batch = input_ids.shape[0]
    count = lanes if lanes is not None else default
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"invalid lanes={lanes!r}: it must be a positive integer")
    count = min(count, batch)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    padded = (mask == 0).any(dim=1).cpu().tolist() if attention_mask is not None else [False] * batch
    size = -(-batch // count)
    out = []
    for start in range(0, batch, size):
        rows = slice(start, min(batch, start + size))
        out.append(Lane(rows, input_ids[rows], mask[rows], padded=any(padded[rows])))
    return out


def place_lanes(stages: CausalLMStages, lanes: list[Lane]) -> None:
    """Move each lane's prompt and mask to the embedding device."""
    for lane in lanes:
        lane.ids, lane.mask = lane.ids.to(stages.embed_device), lane.mask.to(stages.embed_device)
