"""The decode half of the lane runner: each lane's static decode steps on every stage, the token loop that
issues them lane after lane without waiting for a GPU, and the hand-back of tokens to the host a few steps late.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import dynamic_dims, with_decode_attention
from ..kernels.decode_attention import decode_step_attention
from .lane_cache import DecodeInputs, LaneCache
from .lane_prefill import LanePrefill
from .graphed_step import GraphedStep
from .lanes import EOS_CHECK_LAG, Lane, LaneStreams, OnTokens
from .sampling import Sampling, choose
from .step_cache import StepCache
from ..pipelining.streams import copy_into, copy_later, to_host


FEWEST_ROWS = 2  # a decode step over part of a lane computes a power of two of rows from this: a dynamic row count
# of 1 would be specialized by the compiler (a compile of its own, tens of seconds)


def computed_rows(highest: int, rows: int) -> int:
    """The rows a decode step of a lane of `rows` rows computes when its last held row is `highest` (-1: none):
    the smallest power of two from FEWEST_ROWS that holds it, at most the lane's rows. A continuous batch's rows are
    taken first-free-first, so a batch with few requests decodes a few rows, not all its cache holds (attention over
    rows that hold nothing reads their caches for nothing)."""
    need = max(highest + 1, FEWEST_ROWS)
    return min(rows, 1 << (need - 1).bit_length())


class LaneDecode:
    """Decode steps per (stage, lane) of `run`, replayed as CUDA graphs, and the generate loop over them (its
    prompts through `prefill`)."""

    def __init__(self, run: LaneStreams, prefill: LanePrefill) -> None:
        self.run, self.prefill, self.s = run, prefill, run.s  # the stages, as every lane-step names them

    def prepare_decode(self, k: int, lane: Lane, max_len: int, entries: dict | None, cache: StepCache | None) -> None:
        """The lane's static caches and decode steps on every stage (kept from an earlier call of the same
        shapes when `entries` has them)."""
        if entries is not None and k in entries:
            lane.caches, lane.steps, lane.inputs = entries[k]
            lane.row_steps = entries[("rows", k)]
            for item in lane.inputs:
                item.reset(lane.mask)
            return
        float_mask = self.s.float_mask_dtype()
        rows = lane.ids.shape[0]
        inputs = []
        for j, stage in enumerate(self.s.stages):
            with self.run.making(j):  # tokens and hidden states come into them from receive streams
                lane_cache = LaneCache(rows, max_len, stage.device)
                layout = self.s.kv_layout(j)
                if layout is not None:
                    lane_cache.allocate(*layout, self.s.dtype)
                inputs.append(DecodeInputs(lane_cache, lane.mask, float_mask))
                if j == 0:
                    static_in = torch.zeros(rows, 1, dtype=torch.long, device=self.s.embed_device)
                else:
                    static_in = torch.zeros(rows, 1, self.s.config.hidden_size, dtype=self.s.dtype,
                                            device=stage.device)
            lane.caches.append(lane_cache)
            lane.steps.append(self._decode_step(j, static_in, inputs[-1], cache))
        lane.inputs = inputs
        lane.row_steps = {}
        if entries is not None:
            entries[k] = (lane.caches, lane.steps, inputs)
            entries[("rows", k)] = lane.row_steps

    def remake_steps(self, lane: Lane, cache: StepCache | None) -> None:
        """The lane's decode steps made anew over the same buffers and caches (after `run.compile` changed): its
        whole-lane steps now, its steps over first rows and carrying packs at their next use."""
        lane.steps[:] = [self._decode_step(j, old.static_in, lane.inputs[j], cache) for j, old in enumerate(lane.steps)]
        lane.row_steps.clear()

    def _decode_step(self, j: int, static_in: torch.Tensor, inputs: DecodeInputs,
                     cache: StepCache | None) -> GraphedStep:
        """Stage j's decode step reading `static_in` and `inputs` (a lane's, or its first rows'). Compiled, every
        step runs the same compiled regions (`devmap.generation.compiled`): the sizes marked here vary freely."""
        stage = self.s.stages[j]
        # a step touching another device (the head of the last stage, the embedding of the first, living elsewhere)
        # can't be captured (and a failed capture leaves the graph pool unusable): it stays eager
        graphed = self.run.graphs and self.s.captures(j)
        pool = cache.pool(stage.device, j) if cache is not None and graphed else None
        capture = self.run.capture_stream(j) if graphed else None
        if self.run.compile and self.run.dynamic:  # one compile for every rows × cache length (generation.compiled)
            dynamic_dims(static_in, (0,))
            for buffer in inputs.cache.buffers():
                dynamic_dims(buffer, (0, 2))
            dynamic_dims(inputs.attended, (0, 1))
            dynamic_dims(inputs.offset, (0,))
            dynamic_dims(inputs.live, (0,))
        body = with_decode_attention(self.s.config,
                                     self.run.compiled_body(lambda x, j=j, item=inputs: self.s.decode(j, x, item)),
                                     decode_step_attention)
        return GraphedStep(body, static_in, graphed, pool, capture, compiled=self.run.compile)

    def mixed_steps(self, lane: Lane, rows: int, width: int, scratches: list[LaneCache],
                    cache: StepCache | None) -> list[tuple[GraphedStep, torch.Tensor, torch.Tensor]]:
        """The lane's decode steps over its first `rows` rows carrying a pack of `width` prompt tokens
        (`CausalLMStages.mixed`), per stage: (step, the pack's position ids, the pack's mask) to fill before each
        call; the pack's keys and values go into the stage's `scratches[j]`. Made at first use, kept with the
        lane's steps."""
        steps = lane.row_steps.get(("mixed", rows, width))
        if steps is None:
            steps = lane.row_steps[("mixed", rows, width)] = [
                self._mixed_step(j, lane, rows, width, scratches[j], cache) for j in range(len(self.s.stages))]
        return steps

    def _mixed_step(self, j: int, lane: Lane, rows: int, width: int, scratch: LaneCache,
                    cache: StepCache | None) -> tuple[GraphedStep, torch.Tensor, torch.Tensor]:
        stage = self.s.stages[j]
        graphed = self.run.graphs and self.s.captures(j)
        pool = cache.pool(stage.device, j) if cache is not None and graphed else None
        inputs = lane.inputs[j].first_rows(rows)  # views for every row count, the lane's own too: one compile
        tokens = lane.steps[0].static_in[:rows].view(-1)  # the rows' tokens (stage 0 reads them)
        with self.run.on(j), self.run.making(j):  # made on the stage's stream, which fills them before each step
            if j == 0:  # stage 0 reads the pack's token ids, later stages the hidden state of the rows and the pack
                static_in = torch.zeros(width, dtype=torch.long, device=self.s.embed_device)
            else:
                static_in = torch.zeros(rows + width, self.s.config.hidden_size, dtype=self.s.dtype,
                                        device=stage.device)
            positions = torch.zeros(1, width, dtype=torch.long, device=stage.device)
            mask = torch.zeros(1, 1, width, width, dtype=torch.bool, device=stage.device)
        if self.run.compile and self.run.dynamic:  # one compile for every rows × pack width × cache length
            for tensor, dims in ((static_in, (0,)), (tokens, (0,)), (positions, (1,)), (mask, (2, 3)),
                                 (inputs.attended, (0, 1)), (inputs.offset, (0,)), (inputs.live, (0,))):
                dynamic_dims(tensor, dims)
            for buffer in inputs.cache.buffers():
                dynamic_dims(buffer, (0, 2))
            for buffer in scratch.buffers():
                dynamic_dims(buffer, (2,))

        def body(x: torch.Tensor, j: int = j, tokens: torch.Tensor = tokens, inputs: DecodeInputs = inputs,
                 scratch: LaneCache = scratch, mask: torch.Tensor = mask, positions: torch.Tensor = positions) -> Any:
            flat = torch.cat([tokens, x]) if j == 0 else x
            return self.s.mixed(j, flat, inputs.live.shape[0], inputs, scratch,
                                {"attention_mask": mask, "position_ids": positions})

        compiled = self.run.compiled_body(body)
        step = GraphedStep(with_decode_attention(self.s.config, compiled, decode_step_attention),
                           static_in, graphed, pool, self.run.capture_stream(j) if graphed else None,
                           compiled=self.run.compile)
        return step, positions, mask

    def first_rows_steps(self, lane: Lane, rows: int, cache: StepCache | None) -> list[GraphedStep]:
        """The lane's decode steps over its first `rows` rows (made at first use, kept with the lane's steps)."""
        steps = lane.row_steps.get(rows)
        if steps is None:
            steps = lane.row_steps[rows] = [
                self._decode_step(j, lane.steps[j].static_in[:rows], lane.inputs[j].first_rows(rows), cache)
                for j in range(len(self.s.stages))]
        return steps

    def generate(self, max_new_tokens: int, sampling: Sampling, eos: list[int], pad: int,
                 entries: dict | None, cache: StepCache | None, on_tokens: OnTokens | None = None) -> None:
        head_device = self.s.head_device
        eos_ids = torch.tensor(eos, device=head_device) if eos else None
        generator = torch.Generator(device=head_device).manual_seed(sampling.seed) if sampling.do_sample else None
        last = len(self.s.stages) - 1
        self.run.start()
        self.prefill.prompts()

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
                lane.ended.append((self.run.record(compute), flag))
            lane.tokens.append(token)
            lane.unfinished.append(unfinished)
            if on_tokens is not None:  # the host reads them EOS_CHECK_LAG steps later, once the copy's event fired
                host = to_host(token)
                lane.undelivered.append((step, self.run.record(compute), host))
            if step + 1 < max_new_tokens:  # stage 0 waits for it only right before the lane's next step
                lane.token_ready = copy_later(lane.steps[0].static_in.view(-1), token, self.run.record(compute), 0,
                                              self.run.streams)

        for k, lane in enumerate(self.run.lanes):  # prefill, lane after lane: the stages overlap on different lanes
            if entries is None:
                hidden = self.prefill.through(lane, caches=True)
            else:
                hidden = self.prefill.through_graphed(k, lane, entries, cache, caches=True)
            for j, lane_cache in enumerate(lane.caches):
                with self.run.on(j):
                    lane_cache.start_decoding(lane.ids.shape[1])
            with self.run.on(last) as compute:
                finish(lane, self.s.head(hidden[:, -1:, :])[:, -1].float(), compute, 0)
        for step in range(1, max_new_tokens):
            if on_tokens is not None and not self.deliver(on_tokens, step - 1):
                return
            for lane in self.run.lanes:
                if lane.done or _ended(lane, step):
                    lane.done = True
                    continue
                out = self.decode_step(lane)
                with self.run.on(last) as compute:
                    finish(lane, out, compute, step)
        if on_tokens is not None:
            self.deliver(on_tokens, max_new_tokens, lag=0)

    def decode_step(self, lane: Lane, steps: list[GraphedStep] | None = None) -> torch.Tensor:
        """One decode step of the lane through every stage (stage 0 reads its token once it is there): its own
        steps, or `steps` over its first rows (`first_rows_steps`); the last stage's output (float logits)."""
        steps = steps or lane.steps
        out = event = None
        for j in range(len(self.s.stages)):
            with self.run.on(j) as compute:
                if j > 0:
                    copy_into(steps[j].static_in, out, event, j, self.run.streams, compute)
                elif lane.token_ready is not None:
                    compute.wait_event(lane.token_ready)
                with self.run.clock.around(j, compute):
                    out = steps[j].handed_on(steps[j](), j < len(self.s.stages) - 1)
                event = self.run.record(compute)
        return out

    def deliver(self, on_tokens: OnTokens, step: int, lag: int | None = None) -> bool:
        """Hand the host every lane's tokens up to `step - lag` (lag: EOS_CHECK_LAG on GPUs, so the host waits
        for work issued steps ago, never for the step in flight); False when `on_tokens` asks to stop."""
        lag = (EOS_CHECK_LAG if self.s.head_device.type == "cuda" else 0) if lag is None else lag
        go_on = True
        for lane in self.run.lanes:
            while lane.undelivered and lane.undelivered[0][0] <= step - lag:
                index, event, host = lane.undelivered.pop(0)
                if event is not None:
                    event.synchronize()
                go_on = on_tokens(lane.rows, index, host) and go_on
        return go_on


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


