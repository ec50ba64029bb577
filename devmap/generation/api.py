"""Pipelined inference for a placed LLaMA-style model: batched forward and generation in lanes, stages concurrent.

The public entry points; the lanes, streams and captured steps behind them are in lane_runner.py (lanes.py,
lane_prefill.py, lane_decode.py). Greedy decoding gives transformers' tokens; sampling applies temperature, then
top-k, then top-p, with a seeded generator.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .causal_lm import CausalLMStages
from .kv_room import check_kv_room
from ..errors import UsageError
from .lane_runner import LaneRunner, OnTokens, place_lanes, split_lanes
from .sampling import Sampling
from .step_cache import StepCache, step_cache, weight_pointers

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
    graphs: bool = True,
    keep_graphs: bool = True,
    compile: bool = False,
    on_tokens: OnTokens | None = None,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` per row; returns prompt + new tokens (on the CPU), like transformers'
    generate: a row that ends (EOS) is padded with `pad_token_id` until every row has ended.

    Left-pad prompts of different lengths and pass their `attention_mask`. `lanes` (default: the number of
    stages) splits the batch so that the stages work on different lanes at once. `graphs`:
    replay each (stage, lane) decode step as a CUDA graph when every stage is on a GPU (steps that cannot
    be captured run eagerly). Each lane keeps a static KV cache of prompt + `max_new_tokens` tokens.
    `keep_graphs`: keep the caches and captured steps on the model for the next call of the same shapes
    (which then replays its prefill too); they hold GPU memory until another shape comes or
    `devmap.release_graphs(model)`. With False, everything is freed when the call returns.
    `compile`: run each stage's prefill and decode step as torch.compile (inductor) code inside those graphs:
    the first call of each shape compiles (tens of seconds for a 1B model, cached on disk by torch), later
    calls run fused kernels. Worth it for many calls (a service, a batch job), not for one short one.
    `split_layers`: decoder-layer indices that start a new stage even where the device does not change: several
    stages on one GPU (or the CPU) run every multi-GPU path — per-stage streams, hand-offs, graph pools, lanes — which
    is how a multi-GPU layout is checked on one GPU (set DEVMAP_STREAM_CHECK=1 to make ordering mistakes show).
    `on_tokens(rows, step, tokens)`: streams each step's new tokens of each lane (`rows`: a slice of the batch;
    `tokens`: on the CPU, a row that ended holds `pad_token_id`), a couple of steps behind the GPUs so the host
    never waits for the step in flight; returning False stops generation (what was generated is returned).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = Sampling(do_sample, temperature, top_k, top_p, seed)
    sampling.check()
    stages = CausalLMStages(model, split_layers)
    check_length(model.config, input_ids.shape[-1] + max_new_tokens)
    stages.check_window(input_ids.shape[-1] + max_new_tokens)
    stages.float_mask_dtype()  # refuses attention implementations the decode mask does not fit
    config = getattr(model, "generation_config", None) or model.config
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos_list = [eos] if isinstance(eos, int) else list(eos or [])
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_list[0] if eos_list else 0)
    # decoding: every lane-step costs a few hundred small kernels whatever its rows, so the fewest lanes that
    # keep every stage busy (one per stage) are fastest
    lane_list = split_lanes(stages, input_ids, attention_mask, lanes, default=len(stages.stages))
    run = LaneRunner(stages, lane_list, graphs, compile)
    max_len = input_ids.shape[1] + max_new_tokens
    cache = entries = None
    if run.graphs:
        cache = step_cache(model, "generate") if keep_graphs else StepCache()
        signature = (run.layout(), tuple(lane.ids.shape[0] for lane in lane_list), input_ids.shape[1], max_len)
        entries = cache.use(signature, weight_pointers(model))
    if not entries:  # new caches are about to be allocated
        check_kv_room(stages, input_ids.shape[0], max_len, "devmap.generate")
    place_lanes(stages, lane_list)  # after the check: a refused call leaves nothing on the GPUs
    with stages.hooks_bypassed():
        for k, lane in enumerate(lane_list):
            run.decode.prepare_decode(k, lane, max_len, entries, cache)
        run.decode.generate(max_new_tokens, sampling, eos_list, pad, entries if keep_graphs else None, cache, on_tokens)
        run.streams.join([t for lane in lane_list for t in lane.tokens + lane.unfinished])
    lengths = []
    for lane in lane_list:  # a lane's tokens after all its rows ended are padding: trim to where it ended
        ended = ~torch.stack(lane.unfinished).any(dim=1).cpu()
        lengths.append(int(ended.long().argmax()) + 1 if bool(ended.any()) else len(lane.tokens))
    steps = max(lengths)
    rows = []
    for lane in lane_list:
        new = torch.stack(lane.tokens, dim=1).cpu()[:, :steps]
        if new.shape[1] < steps:
            new = torch.cat([new, new.new_full((new.shape[0], steps - new.shape[1]), pad)], dim=1)
        rows.append(torch.cat([input_ids[lane.rows].cpu(), new], dim=1))
    return torch.cat(rows)


def check_length(config: Any, total: int) -> None:
    """Refuse prompt + new tokens beyond the model's context (each lane's static cache holds that many)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and total > limit:
        raise UsageError(
            f"prompt + new tokens = {total:,} is more than the model's context of {limit:,} tokens "
            "(max_position_embeddings); shorten the prompt or --max-new-tokens"
        )


@torch.no_grad()
def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            lanes: int | None = None, split_layers: list[int] | None = None, graphs: bool = True,
            keep_graphs: bool = True, compile: bool = False) -> torch.Tensor:
    """Logits (on the last stage's device) of a whole batch, its lanes flowing through the stages
    concurrently (prefill / scoring). `lanes` defaults to 4 per stage (1 for a single stage).

    With `graphs` and every stage on a GPU, each (stage, lane) runs eagerly the first time a batch shape is
    seen, is captured as a CUDA graph the second time and replayed from then on; the graphs and their
    buffers stay on the model until another shape comes or `devmap.release_graphs(model)`
    (`keep_graphs=False`: nothing is kept, every call runs eagerly). `compile`: those captured prefills are
    torch.compile (inductor) code, compiled on a shape's first call (see `generate`).
    """
    stages = CausalLMStages(model, split_layers)
    stages.check_window(input_ids.shape[-1])
    # prefill: lanes big enough to keep GEMMs efficient, enough of them that filling and draining the
    # pipeline (one lane's time per stage) stays small
    default = 4 * len(stages.stages) if len(stages.stages) > 1 else 1
    lane_list = split_lanes(stages, input_ids, attention_mask, lanes, default=default)
    place_lanes(stages, lane_list)
    run = LaneRunner(stages, lane_list, graphs, compile)
    vocab = stages.model.lm_head.out_features if hasattr(stages.model.lm_head, "out_features") \
        else stages.model.config.vocab_size
    dtype = getattr(stages.model.lm_head, "weight", torch.empty(0, dtype=stages.dtype)).dtype
    out = torch.empty(*input_ids.shape, vocab, dtype=dtype, device=stages.head_device)
    with stages.hooks_bypassed():
        run.prefill.forward(step_cache(model, "forward") if run.graphs and keep_graphs else None, out)
        run.streams.join([out])
    return out


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
