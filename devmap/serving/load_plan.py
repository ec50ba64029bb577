"""What a service plans for each model it loads: the model's weights plus the KV cache and activations of its
largest batch, so that a model the service admits never runs out of memory at that batch.

A batch runs in lanes, one per pipeline stage of the weights' map (or the service's `--lanes`), so that every stage
works on a lane of its own at once (as vLLM's pipeline-parallel engine keeps one scheduled batch per stage); each lane
holds up to the service's `max_batch` rows. A batch has at most lanes × `max_batch` rows, or as many as fit beside the
weights (`devmap.planning.rows_fit`: the most whose plan keeps as much of the model on the GPUs as its weights alone);
each row's cache holds the longest cache a request within the limits may need (`scheduler.largest_cache`). Prompts
join a running batch in packs (`generation.joins`): the plan counts the largest pack's prefill and the scratch cache
its keys and values pass through, not a prefill of every row at once, and the hidden states every captured pack width
keeps.
`devmap serve` and `devmap plan --for serve` plan through here, so both show the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..generation.causal_lm import SAME_GLUE
from ..generation.joins import pack_limit, pack_widths
from ..planning.planner import Plan
from ..planning.rows_fit import rows_that_fit
from ..planning.workload import Workload, parse_workload
from .errors import ServiceError
from .limits import EngineLimits
from .scheduler import largest_cache


@dataclass(frozen=True)
class ServingPlan:
    """The rows of a model's largest batch, the cache tokens of each row, the plan that holds them, and the lanes its
    batches run in (each up to the service's `max_batch` rows)."""

    rows: int
    cache_len: int
    plan: Plan
    lanes: int = 1


def plan_serving(model_source: Any, limits: EngineLimits, plan_with: Callable[[Workload | None], Plan],
                 cache_len: int | None = None) -> ServingPlan:
    """The serving plan of `model_source` (a resolved source) under `limits`; `plan_with(workload)` plans it on the
    caller's devices and budget (None: the weights alone). `cache_len` overrides the cache tokens per row the
    limits give."""
    model_type = getattr(model_source.config, "model_type", None)
    if not model_source.is_causal_lm or model_type not in SAME_GLUE:
        kind = f"a {model_type!r} model" if model_source.is_causal_lm else "not a causal LM"
        raise ServiceError(f"{model_source.name} is {kind}: the service generates text with LLaMA-style models "
                           f"({', '.join(SAME_GLUE)})", param="model")
    context = int(getattr(model_source.config, "max_position_embeddings", 0) or 0)
    if cache_len is None:
        cache_len = largest_cache(limits.scheduling(), limits.max_prompt_tokens, limits.max_new_tokens, context)

    weights = plan_with(None)  # the weights alone: its stages give the lanes, and rows_that_fit compares with it

    def plan_for(rows: int | None) -> Plan:
        return weights if rows is None else plan_with(serving_workload(context, rows, cache_len, lanes))

    lanes = limits.lanes or weights.stages
    rows, plan = rows_that_fit(plan_for, limits.max_batch * lanes)
    return ServingPlan(rows, cache_len, plan, lanes)


def serving_workload(context: int, rows: int, cache_len: int, lanes: int) -> Workload:
    """What a batch of `rows` rows of `cache_len` cache tokens in `lanes` lanes needs beside the weights (a model of
    `context` positions): its KV cache, the largest joining pack's prefill and the captured pack widths."""
    joining = -(-pack_limit(cache_len, rows) // cache_len)  # rows of cache_len tokens holding the largest pack
    captured = sum(pack_widths(pack_limit(cache_len, rows)))
    return parse_workload("serve", causal_lm=True, context=context, batch=rows, seq_len=cache_len,
                          chunks=min(lanes, rows), prefill_rows=min(joining, rows), captured_tokens=captured)
