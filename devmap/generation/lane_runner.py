"""The engine of pipelined LLaMA inference: lanes (micro-batches) issued stage by stage from one thread.

Each lane has its own static KV cache on every stage's device. One thread issues every lane-step in
pipeline order on per-stage CUDA streams, ordered by events, and never waits for a GPU: while stage 1 runs
lane k's step, stage 0 runs lane k+1's, and the last stage's token goes straight back to stage 0 for the
lane's next step. Decode steps, and prefills of a batch shape seen before, are replayed CUDA graphs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .causal_lm import CausalLMStages, FrontHead, positions
from ..errors import UsageError
from .compiled import compile_step
from .graphed_step import GraphedStep
from .lane_cache import DecodeInputs, LaneCache
from .sampling import Sampling, choose
from .step_cache import StepCache, weight_pointers
from ..pipelining.streams import StreamSet, copy_into, copy_later, hand_off, to_host

EOS_CHECK_LAG = 2  # steps between a lane's last token and the host reading whether its rows all ended


@dataclass
class Lane:
    rows: slice
    ids: torch.Tensor  # the prompt, on the embedding device
    mask: torch.Tensor  # its attention mask, on the embedding device
    padded: bool
    caches: list[LaneCache] = field(default_factory=list)  # per stage
    steps: list[GraphedStep] = field(default_factory=list)  # decode step per stage
    inputs: list[DecodeInputs] = field(default_factory=list)  # decode-step inputs per stage
    tokens: list[torch.Tensor] = field(default_factory=list)
    unfinished: list[torch.Tensor] = field(default_factory=list)  # after each token: rows still generating
    ended: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # (event, host flag "all rows ended")
    done: bool = False
    prompt: dict[str, Any] = field(default_factory=dict)  # mask, position ids (stage 0's device), ready event
    token_ready: Any = None  # event: the lane's last token is in stage 0's input buffer
    undelivered: list[tuple[int, Any, torch.Tensor]] = field(default_factory=list)  # (step, event, host tokens)


class LaneRunner:
    """One generate() or forward() call: every lane-step issued from this thread, stages on their own streams."""

    def __init__(self, stages: CausalLMStages, lanes: list[Lane], graphs: bool, compile: bool = False,
                 compile_prefill: bool | None = None) -> None:
        self.s, self.lanes = stages, lanes
        self.streams = StreamSet()
        self.graphs = graphs and graphs_possible(stages.devices)
        self.compile = compile  # decode steps through torch.compile
        self.compile_prefill = compile if compile_prefill is None else compile_prefill
        self._plain: dict[tuple[int, int], dict[str, Any]] = {}

    def _capture_stream(self, j: int) -> Any:
        device = self.s.stages[j].device
        return self.streams.get("capture", j, device) if device.type == "cuda" else None

    def layout(self) -> tuple:
        """What identifies the stages for cached steps."""
        return tuple((str(st.device), id(st.layers[0]), len(st.layers)) for st in self.s.stages)

    def start(self) -> None:
        """Every stage's stream waits for the caller's work so far (inputs, fresh buffers)."""
        for j, stage in enumerate(self.s.stages):
            if stage.device.type == "cuda":
                self.streams.get("compute", j, stage.device).wait_stream(torch.cuda.current_stream(stage.device))
        if self.s.embed_device.type == "cuda":
            self.streams.get("compute", 0, self.s.stages[0].device).wait_stream(
                torch.cuda.current_stream(self.s.embed_device))

    @contextlib.contextmanager
    def on(self, j: int, kind: str = "compute") -> Iterator[Any]:
        """Stage j's device and its stream of this kind (None on a CPU)."""
        device = self.s.stages[j].device
        if device.type != "cuda":
            yield None
            return
        stream = self.streams.get(kind, j, device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield stream

    def prompts(self) -> None:
        """The causal mask and position ids of every lane with padding, made before any lane's work is issued
        (attention implementations other than sdpa and eager use transformers' mask code, which reads padding on the
        host: that would stall the pipeline once per lane)."""
        for lane in self.lanes:
            if lane.padded:
                self.prompt(lane)

    def prompt(self, lane: Lane) -> dict[str, Any]:
        """The lane's prompt context (mask, position ids) on stage 0's device, computed on first use; lanes
        without padding share one mask per shape, and their positions are 0..length-1."""
        if lane.prompt:
            return lane.prompt
        rows, length = lane.ids.shape
        with self.on(0) as first:
            device = self.s.stages[0].device
            like = torch.empty(rows, length, 0, dtype=self.s.dtype, device=device)  # shape, dtype, device only
            if lane.padded:
                context = self.s.prompt_context(lane.mask, positions(lane.mask, length).to(device), like)
            else:
                if (rows, length) not in self._plain:  # no padding: no host reads, so made between lanes' work
                    position_ids = torch.arange(length, device=device).expand(rows, length)
                    self._plain[(rows, length)] = self.s.prompt_context(None, position_ids, like)
                context = self._plain[(rows, length)]
            lane.prompt = {"context": context, "ready": record_event(first)}
        return lane.prompt

    def through(self, lane: Lane, caches: bool) -> torch.Tensor:
        """A lane's whole prompt through every stage (caches filled when asked); the last stage's hidden state."""
        hidden = context = event = None
        for j, stage in enumerate(self.s.stages):
            with self.on(j) as compute:
                if j == 0:
                    hidden = self.s.embed(lane.ids).to(stage.device)
                    context = dict(self.prompt(lane)["context"])
                    context["position_embeddings"] = self.s.rotary(hidden, context["position_ids"])
                elif compute is not None:
                    hidden = hand_off(hidden, event, stage.device, j, self.streams, compute)
                    context = {k: _move(v, event, stage.device, j, self.streams, compute) for k, v in context.items()}
                else:
                    hidden = hidden.to(stage.device)
                    context = {k: _move(v, None, stage.device, j, self.streams, None) for k, v in context.items()}
                hidden = self.s.run(j, hidden, context, lane.caches[j] if caches else None)
                event = record_event(compute)
        return hidden

    def forward(self, cache: StepCache | None, out: torch.Tensor) -> None:
        """Every lane's logits, into `out`; with a step cache, each (stage, lane) prefill is a replayed graph."""
        self.start()
        self.prompts()
        entries = None
        if cache is not None and self.graphs:
            signature = (self.layout(), tuple(tuple(lane.ids.shape) for lane in self.lanes))
            entries = cache.use(signature, weight_pointers(self.s.model))
        front = self.front_head(out)
        last = len(self.s.stages) - 1
        for k, lane in enumerate(self.lanes):
            hidden = self.through(lane, caches=False) if entries is None else self.through_graphed(
                k, lane, entries, cache, leaves=front is not None)  # half of the last stage's output goes to the front
            cut = hidden.shape[0] // 2 if front is not None else 0
            with self.on(last) as compute:
                self.s.head_into(hidden[cut:], out[lane.rows][cut:])
                event = record_event(compute)
            if cut:  # the first stage, which has no head, projects the other half of the lane's rows
                self.front_rows(front, hidden[:cut], event, out[lane.rows][:cut])

    def front_head(self, out: torch.Tensor) -> Any:
        """A copy of the norm and LM head on the first stage's device, when splitting the head's rows with it pays:
        two stages or more, a plain bias-free head, and memory to spare there."""
        if len(self.s.stages) < 2 or not self.s.head_splittable():
            return None
        device = self.s.stages[0].device
        weight = self.s.model.lm_head.weight
        if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 4 * weight.numel() * weight.element_size():
            return None
        with self.on(0, "head"):
            return FrontHead(self.s, device)

    def front_rows(self, front: Any, hidden: torch.Tensor, event: Any, out: torch.Tensor) -> None:
        """Logits of `hidden`'s rows on the first stage's head stream (beside its layers' work), copied into `out`."""
        device = self.s.stages[0].device
        pseudo = len(self.s.stages)  # stream keys of their own: the stages' hand-offs never wait behind these
        with self.on(0, "head") as stream:
            if stream is not None:
                hidden = hand_off(hidden, event, device, pseudo, self.streams, stream)
            else:
                hidden = hidden.to(device)
            logits = torch.empty(out.shape, dtype=out.dtype, device=device)
            front.into(hidden, logits)
            gather = self.streams.get("gather", pseudo, out.device) if out.is_cuda else None
            copy_into(out, logits, record_event(stream), pseudo, self.streams, gather)

    def through_graphed(self, k: int, lane: Lane, entries: dict, cache: StepCache, caches: bool = False,
                        leaves: bool = False) -> torch.Tensor:
        """`through` with every stage's prefill of this lane shape captured once and replayed after (writing
        the lane's static KV caches when `caches`); `leaves`: the last stage's output is read on another stream."""
        rows, length = lane.ids.shape
        prompt = self.prompt(lane)
        position_ids, mask, ready = prompt["context"]["position_ids"], prompt["context"]["attention_mask"], \
            prompt["ready"]
        mask_key = None if mask is None else (tuple(mask.shape), mask.dtype)
        out = event = None
        for j, stage in enumerate(self.s.stages):
            with self.on(j) as compute:
                key = ("prefill", j, k, mask_key)
                if key not in entries:
                    entries[key] = self.prefill_step(j, rows, length, mask, cache, lane.caches[j] if caches else None)
                step, static_positions, static_mask = entries[key]
                copy_into(step.static_in, lane.ids if j == 0 else out, None if j == 0 else event, j, self.streams,
                          compute)
                copy_into(static_positions, position_ids, ready, j, self.streams, compute)
                if static_mask is not None:
                    copy_into(static_mask, mask, ready, j, self.streams, compute)
                out = step.handed_on(step(), leaves or j < len(self.s.stages) - 1)
                event = record_event(compute)
        return out

    def prefill_step(self, j: int, rows: int, length: int, mask: torch.Tensor | None, cache: StepCache,
                     lane_cache: LaneCache | None) -> tuple[GraphedStep, torch.Tensor, torch.Tensor | None]:
        """Stage j's layers over a whole prompt of this shape, reading fixed buffers (ids or hidden state,
        positions, mask)."""
        stage = self.s.stages[j]
        device = stage.device
        if j == 0:
            static_in = torch.zeros(rows, length, dtype=torch.long, device=self.s.embed_device)
        else:
            static_in = torch.zeros(rows, length, self.s.config.hidden_size, dtype=self.s.dtype, device=device)
        static_positions = torch.zeros(rows, length, dtype=torch.long, device=device)
        static_mask = None if mask is None else torch.zeros(mask.shape, dtype=mask.dtype, device=device)

        def body(x: torch.Tensor) -> torch.Tensor:
            hidden = self.s.embed(x).to(device) if j == 0 else x
            context = {"attention_mask": static_mask, "position_ids": static_positions,
                       "position_embeddings": self.s.rotary(hidden, static_positions)}
            return self.s.run(j, hidden, context, lane_cache)

        body = compile_step(body) if self.compile_prefill else body
        step = GraphedStep(body, static_in, True, cache.pool(device, j), self._capture_stream(j))
        return step, static_positions, static_mask

    def _compiled(self, body: Any) -> Any:
        return compile_step(body) if self.compile else body

    def prepare_decode(self, k: int, lane: Lane, max_len: int, entries: dict | None, cache: StepCache | None) -> None:
        """The lane's static caches and decode steps on every stage (kept from an earlier call of the same
        shapes when `entries` has them)."""
        if entries is not None and k in entries:
            lane.caches, lane.steps, lane.inputs = entries[k]
            for item in lane.inputs:
                item.reset(lane.mask)
            return
        float_mask = self.s.float_mask_dtype()
        rows = lane.ids.shape[0]
        inputs = []
        for j, stage in enumerate(self.s.stages):
            lane_cache = LaneCache(rows, max_len, stage.device)
            layout = self.s.kv_layout(j)
            if layout is not None:
                lane_cache.allocate(*layout, self.s.dtype)
            inputs.append(DecodeInputs(lane_cache, lane.mask, float_mask))
            if j == 0:
                static_in = torch.zeros(rows, 1, dtype=torch.long, device=self.s.embed_device)
            else:
                static_in = torch.zeros(rows, 1, self.s.config.hidden_size, dtype=self.s.dtype, device=stage.device)
            # the last stage's step ends in the head: a copy to another device can't be captured (and a failed
            # capture leaves the graph pool unusable), so that step stays eager when the head lives elsewhere
            graphed = self.graphs and (j + 1 < len(self.s.stages) or self.s.head_is_on(stage.device))
            pool = cache.pool(stage.device, j) if cache is not None and graphed else None
            capture = self._capture_stream(j) if graphed else None
            lane.caches.append(lane_cache)
            body = self._compiled(lambda x, j=j, item=inputs[-1]: self.s.decode(j, x, item))
            lane.steps.append(GraphedStep(body, static_in, graphed, pool, capture))
        lane.inputs = inputs
        if entries is not None:
            entries[k] = (lane.caches, lane.steps, inputs)

    def generate(self, max_new_tokens: int, sampling: Sampling, eos: list[int], pad: int,
                 entries: dict | None, cache: StepCache | None, on_tokens: OnTokens | None = None) -> None:
        head_device = self.s.head_device
        eos_ids = torch.tensor(eos, device=head_device) if eos else None
        generator = torch.Generator(device=head_device).manual_seed(sampling.seed) if sampling.do_sample else None
        last = len(self.s.stages) - 1
        self.start()
        self.prompts()

        def finish(lane: Lane, logits: torch.Tensor, compute: Any, step: int) -> None:
            """The lane's next token from its logits, on the last stage; sent to stage 0 if another step follows."""
            token = choose(logits, sampling, generator)
            if lane.unfinished:
                token = token.masked_fill(~lane.unfinished[-1], pad)
                unfinished = lane.unfinished[-1]
            else:
                unfinished = torch.ones_like(token, dtype=torch.bool)
            if eos_ids is not None:
                unfinished = unfinished & ~torch.isin(token, eos_ids)
                flag = torch.empty((), dtype=torch.bool, pin_memory=token.is_cuda)
                flag.copy_(~unfinished.any(), non_blocking=True)
                lane.ended.append((record_event(compute), flag))
            lane.tokens.append(token)
            lane.unfinished.append(unfinished)
            if on_tokens is not None:  # the host reads them EOS_CHECK_LAG steps later, when they surely are there
                lane.undelivered.append((step, record_event(compute), to_host(token)))
            if step + 1 < max_new_tokens:  # stage 0 waits for it only right before the lane's next step
                lane.token_ready = copy_later(lane.steps[0].static_in.view(-1), token, record_event(compute), 0,
                                              self.streams)

        for k, lane in enumerate(self.lanes):  # prefill, lane after lane: the stages overlap on different lanes
            if entries is None:
                hidden = self.through(lane, caches=True)
            else:
                hidden = self.through_graphed(k, lane, entries, cache, caches=True)
            for j, lane_cache in enumerate(lane.caches):
                with self.on(j):
                    lane_cache.start_decoding(lane.ids.shape[1])
            with self.on(last) as compute:
                finish(lane, self.s.head(hidden[:, -1:, :])[:, -1].float(), compute, 0)
        for step in range(1, max_new_tokens):
            if on_tokens is not None and not self.deliver(on_tokens, step - 1):
                return
            for lane in self.lanes:
                if lane.done or _ended(lane, step):
                    lane.done = True
                    continue
                out = self.decode_step(lane)
                with self.on(last) as compute:
                    finish(lane, out, compute, step)
        if on_tokens is not None:
            self.deliver(on_tokens, max_new_tokens, lag=0)

    def decode_step(self, lane: Lane) -> torch.Tensor:
        """One decode step of the lane through every stage (stage 0 reads its token once it is there); the last
        stage's output (float logits)."""
        out = event = None
        for j in range(len(self.s.stages)):
            with self.on(j) as compute:
                if j > 0:
                    copy_into(lane.steps[j].static_in, out, event, j, self.streams, compute)
                elif lane.token_ready is not None:
                    compute.wait_event(lane.token_ready)
                out = lane.steps[j].handed_on(lane.steps[j](), j < len(self.s.stages) - 1)
                event = record_event(compute)
        return out

    def deliver(self, on_tokens: OnTokens, step: int, lag: int | None = None) -> bool:
        """Hand the host every lane's tokens up to `step - lag` (lag: EOS_CHECK_LAG on GPUs, so the host waits
        for work issued steps ago, never for the step in flight); False when `on_tokens` asks to stop."""
        lag = (EOS_CHECK_LAG if self.s.head_device.type == "cuda" else 0) if lag is None else lag
        go_on = True
        for lane in self.lanes:
            while lane.undelivered and lane.undelivered[0][0] <= step - lag:
                index, event, host = lane.undelivered.pop(0)
                if event is not None:
                    event.synchronize()
                go_on = on_tokens(lane.rows, index, host) and go_on
        return go_on


OnTokens = Callable[[slice, int, torch.Tensor], bool]
"""Called with (the lane's rows of the batch, the step, those rows' tokens on the CPU); False stops generation."""


def graphs_possible(devices: list[torch.device]) -> bool:
    """CUDA graphs need every stage on a GPU (tests make this True on a CPU to run the cached-step paths,
    whose steps then stay eager)."""
    return all(d.type == "cuda" for d in devices)


def _ended(lane: Lane, step: int) -> bool:
    """Whether every row of the lane had ended EOS_CHECK_LAG steps ago (so the host rarely waits for the GPU;
    the extra steps of an ended lane only produce padding, trimmed at the end)."""
    index = step - 1 - (EOS_CHECK_LAG if lane.tokens[0].is_cuda else 0)
    if not lane.ended or index < 0:
        return False
    event, flag = lane.ended[index]
    if event is not None:
        event.synchronize()
    return bool(flag)


def record_event(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _move(value: Any, event: Any, device: torch.device, j: int, streams: StreamSet, compute: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return hand_off(value, event, device, j, streams, compute) if compute is not None else value.to(device)
    if isinstance(value, tuple):
        return tuple(_move(v, event, device, j, streams, compute) for v in value)
    return value


def split_lanes(stages: CausalLMStages, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           lanes: int | None, default: int) -> list[Lane]:
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
        out.append(Lane(rows, input_ids[rows].to(stages.embed_device), mask[rows].to(stages.embed_device),
                         padded=any(padded[rows])))
    return out
