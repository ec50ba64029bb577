"""The prefill half of the lane runner: each lane's prompt through every stage (eagerly, or as captured steps
kept per batch shape), with its mask and positions made before any lane's work is issued, and the first stage's
share of the LM head for a batch's logits.
"""

from __future__ import annotations

from typing import Any

import torch

from .causal_lm import FrontHead, positions
from ..compat import dynamic_dims
from .graphed_step import GraphedStep
from .lane_cache import LaneCache
from .lanes import Lane, LaneStreams, move_to_stage
from .step_cache import StepCache, weight_pointers
from ..pipelining.streams import copy_into, hand_off


class LanePrefill:
    """Prompts through the stages of `run`, lane after lane (stage j runs lane k while stage j + 1 runs lane k - 1),
    and the prompt contexts it made (per shape, for lanes without padding)."""

    def __init__(self, run: LaneStreams) -> None:
        self.run, self.s = run, run.s  # the stages, as every lane-step names them
        self._plain: dict[tuple[int, int], dict[str, Any]] = {}

    def prompts(self) -> None:
        """The causal mask and position ids of every lane with padding, made before any lane's work is issued
        (attention implementations other than sdpa and eager use transformers' mask code, which reads padding on the
        host: that would stall the pipeline once per lane)."""
        for lane in self.run.lanes:
            if lane.padded:
                self.prompt(lane)

    def prompt(self, lane: Lane) -> dict[str, Any]:
        """The lane's prompt context (mask, position ids) on stage 0's device, computed on first use; lanes
        without padding share one mask per shape, and their positions are 0..length-1."""
        if lane.prompt:
            return lane.prompt
        rows, length = lane.ids.shape
        with self.run.on(0) as first:
            device = self.s.stages[0].device
            like = torch.empty(rows, length, 0, dtype=self.s.dtype, device=device)  # shape, dtype, device only
            if lane.padded:
                context = self.s.prompt_context(lane.mask, positions(lane.mask, length).to(device), like)
            else:
                if (rows, length) not in self._plain:  # no padding: no host reads, so made between lanes' work
                    position_ids = torch.arange(length, device=device).expand(rows, length)
                    self._plain[(rows, length)] = self.s.prompt_context(None, position_ids, like)
                context = self._plain[(rows, length)]
            lane.prompt = {"context": context, "ready": self.run.record(first)}
        return lane.prompt

    def through(self, lane: Lane, caches: bool) -> torch.Tensor:
        """A lane's whole prompt through every stage (caches filled when asked); the last stage's hidden state."""
        hidden = context = event = None
        for j, stage in enumerate(self.s.stages):
            with self.run.on(j) as compute:
                if j == 0:
                    hidden = self.s.embed(lane.ids).to(stage.device)
                    context = dict(self.prompt(lane)["context"])
                    context["position_embeddings"] = self.s.rotary(hidden, context["position_ids"])
                elif compute is not None:
                    hidden = hand_off(hidden, event, stage.device, j, self.run.streams, compute)
                    context = {k: move_to_stage(v, event, stage.device, j, self.run.streams, compute)
                               for k, v in context.items()}
                else:
                    hidden = hidden.to(stage.device)
                    context = {k: move_to_stage(v, None, stage.device, j, self.run.streams, None)
                               for k, v in context.items()}
                hidden = self.s.run(j, hidden, context, lane.caches[j] if caches else None)
                event = self.run.record(compute)
        return hidden

    def forward(self, cache: StepCache | None, out: torch.Tensor) -> None:
        """Every lane's logits, into `out`; with a step cache, each (stage, lane) prefill is a replayed graph."""
        self.run.start()
        self.prompts()
        entries = None
        if cache is not None and self.run.graphs:
            signature = (self.run.layout(), tuple(tuple(lane.ids.shape) for lane in self.run.lanes))
            entries = cache.use(signature, weight_pointers(self.s.model))
        front = self.front_head(out)
        last = len(self.s.stages) - 1
        for k, lane in enumerate(self.run.lanes):
            hidden = self.through(lane, caches=False) if entries is None else self.through_graphed(
                k, lane, entries, cache, leaves=front is not None)  # half of the last stage's output goes to the front
            cut = hidden.shape[0] // 2 if front is not None else 0
            with self.run.on(last) as compute:
                self.s.head_into(hidden[cut:], out[lane.rows][cut:])
                event = self.run.record(compute)
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
        with self.run.on(0, "head"):
            return FrontHead(self.s, device)

    def front_rows(self, front: Any, hidden: torch.Tensor, event: Any, out: torch.Tensor) -> None:
        """Logits of `hidden`'s rows on the first stage's head stream (beside its layers' work), copied into `out`."""
        device = self.s.stages[0].device
        pseudo = len(self.s.stages)  # stream keys of their own: the stages' hand-offs never wait behind these
        with self.run.on(0, "head") as stream:
            if stream is not None:
                hidden = hand_off(hidden, event, device, pseudo, self.run.streams, stream)
            else:
                hidden = hidden.to(device)
            logits = torch.empty(out.shape, dtype=out.dtype, device=device)
            front.into(hidden, logits)
            gather = self.run.streams.get("gather", pseudo, out.device) if out.is_cuda else None
            copy_into(out, logits, self.run.record(stream), pseudo, self.run.streams, gather)

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
            with self.run.on(j) as compute:
                key = ("prefill", j, k, mask_key)
                if key not in entries:
                    entries[key] = self.prefill_step(j, rows, length, mask, cache, lane.caches[j] if caches else None)
                step, static_positions, static_mask = entries[key]
                copy_into(step.static_in, lane.ids if j == 0 else out, None if j == 0 else event, j, self.run.streams,
                          compute)
                copy_into(static_positions, position_ids, ready, j, self.run.streams, compute)
                if static_mask is not None:
                    copy_into(static_mask, mask, ready, j, self.run.streams, compute)
                out = step.handed_on(step(), leaves or j < len(self.s.stages) - 1)
                event = self.run.record(compute)
        return out

    def prefill_step(self, j: int, rows: int, length: int, mask: torch.Tensor | None, cache: StepCache,
                     lane_cache: LaneCache | None) -> tuple[GraphedStep, torch.Tensor, torch.Tensor | None]:
        """Stage j's layers over a whole prompt of this shape, reading fixed buffers (ids or hidden state,
        positions, mask), made on the stage's stream (called inside `on(j)`)."""
        stage = self.s.stages[j]
        device = stage.device
        with self.run.making(j):  # the next stage's hand-offs write them from a receive stream
            if j == 0:
                static_in = torch.zeros(rows, length, dtype=torch.long, device=self.s.embed_device)
            else:
                static_in = torch.zeros(rows, length, self.s.config.hidden_size, dtype=self.s.dtype, device=device)
            static_positions = torch.zeros(rows, length, dtype=torch.long, device=device)
            static_mask = None if mask is None else torch.zeros(mask.shape, dtype=mask.dtype, device=device)
        if self.run.compile and self.run.dynamic:  # one compile for every prompt length (a continuous batch's packs)
            dynamic_dims(static_in, (1,))
            dynamic_dims(static_positions, (1,))
            if static_mask is not None:
                dynamic_dims(static_mask, (2, 3))
            for buffer in lane_cache.buffers() if lane_cache is not None else []:
                dynamic_dims(buffer, (2,))  # a scratch cache's columns: a batch's pack limit

        def body(x: torch.Tensor) -> torch.Tensor:
            hidden = self.s.embed(x).to(device) if j == 0 else x
            context = {"attention_mask": static_mask, "position_ids": static_positions,
                       "position_embeddings": self.s.rotary(hidden, static_positions)}
            return self.s.run(j, hidden, context, lane_cache)

        body = self.run.compiled_body(body)
        graphed = self.run.graphs and self.s.captures(j, head=False)  # a prompt's prefill ends before the head
        step = GraphedStep(body, static_in, graphed, cache.pool(device, j) if graphed else None,
                           self.run.capture_stream(j) if graphed else None, compiled=self.run.compile)
        return step, static_positions, static_mask

