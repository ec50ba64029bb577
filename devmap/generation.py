"""Pipelined inference for a placed LLaMA-style model: batched forward and generation in lanes, stages concurrent.

The batch is split into lanes (micro-batches), each with its own KV cache on every stage's device. One
worker thread per stage takes lane steps in order from its queue, so while stage 1 runs lane k's step,
stage 0 runs lane k+1's; the last stage picks each lane's next token and hands it back to stage 0.
With at least as many lanes as stages every stage stays busy. Greedy decoding gives transformers'
tokens; sampling applies temperature, then top-k, then top-p, with a seeded generator.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .causal_lm import CausalLMStages, positions
from .errors import UsageError
from .streams import StreamSet, hand_off


@dataclass
class Sampling:
    """How the next token is chosen."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature <= 0:
            raise UsageError(f"temperature must be positive, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UsageError(f"top_k must be >= 0 and top_p in (0, 1], got {self.top_k} and {self.top_p}")


@dataclass
class _Lane:
    rows: slice
    ids: torch.Tensor  # next input ids (the prompt, then one token per row)
    mask: torch.Tensor  # attention mask so far, on the embedding device
    cache: Any
    event: Any = None
    step: int = 0
    tokens: list[torch.Tensor] = field(default_factory=list)
    unfinished: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    padded: bool = True


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    if not sampling.do_sample:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > sampling.top_p  # keep the first token past top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


class _Run:
    """One generate() or forward() call: lanes flowing through per-stage worker threads."""

    def __init__(self, stages: CausalLMStages, lanes: list[_Lane], max_new_tokens: int, sampling: Sampling,
                 eos: list[int], pad: int, full_logits: bool) -> None:
        self.s, self.lanes, self.max_new, self.sampling = stages, lanes, max_new_tokens, sampling
        self.eos = torch.tensor(eos, device=stages.head_device) if eos else None
        self.pad, self.full_logits = pad, full_logits
        self.queues: list[queue.Queue] = [queue.Queue() for _ in stages.stages]
        self.streams = StreamSet()
        self.errors: list[BaseException] = []
        self.active = len(lanes)
        self.generator = None
        if sampling.do_sample:
            self.generator = torch.Generator(device=stages.head_device).manual_seed(sampling.seed)

    def run(self, threads: bool = True) -> None:
        for lane in self.lanes:
            self.queues[0].put((lane, None, None, None))
        if not threads:
            self._run_inline()
            return
        threads = [threading.Thread(target=self._worker, args=(j,), daemon=True) for j in range(len(self.queues))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]

    def _run_inline(self) -> None:
        """One thread issues every lane-step, latest stage first: on GPUs the work still overlaps (launches are
        asynchronous) and no thread waits for another to release the GIL."""
        with torch.no_grad():
            while True:
                for j in reversed(range(len(self.queues))):
                    try:
                        item = self.queues[j].get_nowait()
                    except queue.Empty:
                        continue
                    if item is None:
                        if j + 1 == len(self.queues):
                            return
                        self.queues[j + 1].put(None)
                    else:
                        self._step(j, *item)
                    break

    def _worker(self, j: int) -> None:
        # grad mode is thread-local: without this every op would record autograd history, and the KV caches
        # would keep every step's graph alive
        try:
            with torch.no_grad():
                self._loop(j)
        except BaseException as exc:  # raised in the caller; unblock every other worker
            self.errors.append(exc)
            for q in self.queues:
                q.put(None)

    def _loop(self, j: int) -> None:
        while True:
            item = self.queues[j].get()
            if item is None:
                if j + 1 < len(self.queues):
                    self.queues[j + 1].put(None)
                return
            self._step(j, *item)

    def _step(self, j: int, lane: _Lane, hidden: Any, context: Any, event: Any) -> None:
        stage = self.s.stages[j]
        device = stage.device
        cuda = device.type == "cuda"
        compute = self.streams.get("compute", j, device) if cuda else None
        with torch.cuda.device(device) if cuda else _Null(), torch.cuda.stream(compute) if cuda else _Null():
            if j == 0:
                ids = hand_off(lane.ids, lane.event, device, j, self.streams, compute) if cuda else lane.ids
                hidden = self.s.embed(ids)
                length = hidden.shape[1]
                # no padding: no mask, so attention keeps its causal fast path (as transformers does)
                mask = lane.mask if lane.padded else None
                context = self.s.context(hidden, mask, positions(lane.mask, length), lane.cache)
            elif cuda:
                hidden = hand_off(hidden, event, device, j, self.streams, compute)
                context = {k: _move(v, event, device, j, self.streams, compute) for k, v in context.items()}
            else:
                hidden = hidden.to(device)
                context = {k: _move(v, None, device, j, self.streams, None) for k, v in context.items()}
            hidden = self.s.run(j, hidden, context, lane.cache)
            done = None
            if cuda:
                done = torch.cuda.Event()
                done.record(compute)
            if j + 1 < len(self.queues):
                self.queues[j + 1].put((lane, hidden, context, done))
                return
            self._finish(lane, hidden)

    def _finish(self, lane: _Lane, hidden: torch.Tensor) -> None:
        """Last stage: logits, the next token, and the lane's next step (or its end)."""
        if self.full_logits:
            lane.logits = self.s.head(hidden)
            self._retire()
            return
        logits = self.s.head(hidden[:, -1:, :])[:, -1].float()
        token = _choose(logits, self.sampling, self.generator)
        if lane.unfinished is None:
            lane.unfinished = torch.ones_like(token, dtype=torch.bool)
        token = torch.where(lane.unfinished, token, torch.full_like(token, self.pad))
        if self.eos is not None:
            lane.unfinished = lane.unfinished & ~torch.isin(token, self.eos)
        lane.tokens.append(token)
        lane.step += 1
        if lane.step >= self.max_new or not bool(lane.unfinished.any()):
            self._retire()
            return
        embed_device = self.s.embed_device
        lane.ids = token.view(-1, 1).to(embed_device, non_blocking=True)
        lane.mask = torch.cat([lane.mask, lane.mask.new_ones(lane.mask.shape[0], 1)], dim=1)
        if token.is_cuda:
            lane.event = torch.cuda.Event()
            lane.event.record(torch.cuda.current_stream(token.device))
        self.queues[0].put((lane, None, None, None))

    def _retire(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.queues[0].put(None)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _move(value: Any, event: Any, device: torch.device, j: int, streams: StreamSet, compute: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return hand_off(value, event, device, j, streams, compute) if compute is not None else value.to(device)
    if isinstance(value, tuple):
        return tuple(_move(v, event, device, j, streams, compute) for v in value)
    return value


def _lanes(stages: CausalLMStages, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           lanes: int | None, cache: bool) -> list[_Lane]:
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise UsageError(f"input_ids must be a non-empty (batch, length) tensor, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    batch = input_ids.shape[0]
    count = lanes if lanes is not None else min(batch, max(2, len(stages.stages)))
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"invalid lanes={lanes!r}: it must be a positive integer")
    count = min(count, batch)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    size = -(-batch // count)
    out = []
    for start in range(0, batch, size):
        rows = slice(start, min(batch, start + size))
        lane_mask = mask[rows].to(stages.embed_device)
        out.append(_Lane(rows, input_ids[rows].to(stages.embed_device), lane_mask,
                         stages.new_cache() if cache else None, padded=bool((lane_mask == 0).any())))
    return out


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    lanes: int | None = None,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    split_layers: list[int] | None = None,
    threads: bool = True,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` per row; returns prompt + new tokens (on the CPU), like transformers'
    generate: a row that ends (EOS) is padded with `pad_token_id` until every row has ended.

    Left-pad prompts of different lengths and pass their `attention_mask`. `lanes` (default: the number of
    stages, at least 2) splits the batch so that the stages work on different lanes at once. `threads`:
    one worker thread per stage (default), or one thread issuing every stage's work in pipeline order.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = Sampling(do_sample, temperature, top_k, top_p, seed)
    sampling.check()
    stages = CausalLMStages(model, split_layers)
    config = getattr(model, "generation_config", None) or model.config
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos_list = [eos] if isinstance(eos, int) else list(eos or [])
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_list[0] if eos_list else 0)
    lane_list = _lanes(stages, input_ids, attention_mask, lanes, cache=True)
    _Run(stages, lane_list, max_new_tokens, sampling, eos_list, pad, full_logits=False).run(threads)
    steps = max(len(lane.tokens) for lane in lane_list)
    rows = []
    for lane in lane_list:
        new = torch.stack(lane.tokens, dim=1).cpu()
        if new.shape[1] < steps:
            new = torch.cat([new, new.new_full((new.shape[0], steps - new.shape[1]), pad)], dim=1)
        rows.append(torch.cat([input_ids[lane.rows].cpu(), new], dim=1))
    return torch.cat(rows)


@torch.no_grad()
def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            lanes: int | None = None, split_layers: list[int] | None = None, threads: bool = True) -> torch.Tensor:
    """Logits (on the last stage's device) of a whole batch, its lanes flowing through the stages
    concurrently (prefill / scoring)."""
    stages = CausalLMStages(model, split_layers)
    lane_list = _lanes(stages, input_ids, attention_mask, lanes, cache=False)
    _Run(stages, lane_list, 1, Sampling(), [], 0, full_logits=True).run(threads)
    return torch.cat([lane.logits for lane in lane_list])


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(result, seconds) with every GPU synchronized before and after."""
    def sync() -> None:
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)

    sync()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync()
    return result, time.perf_counter() - start
