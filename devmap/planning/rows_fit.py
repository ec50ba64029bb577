"""The most rows a causal LM can serve: the largest batch whose KV cache and activations fit beside its weights.

A serving plan makes room for its largest batch, every row holding a cache of the longest length a request may
need. Like vLLM sizing its KV cache from the memory the weights leave, the rows a model gets are the most (up to
the service's `max_batch`) whose plan keeps as much of the model on the GPUs as a plan for its weights alone;
one row that does not fit is refused with the numbers.
"""

from __future__ import annotations

from typing import Callable

from ..errors import DoesNotFitError
from .devices import is_gpu
from .memory import format_bytes
from .planner import Plan

PlanFor = Callable[[int | None], Plan]
"""rows -> the plan for serving that many rows (None: the weights alone)."""


def rows_that_fit(plan_for: PlanFor, most: int) -> tuple[int, Plan]:
    """The most rows in 1..`most` whose plan fits, with that plan: `most` itself where it fits (a service with room
    to spare plans twice), else a binary search (more rows never need less)."""
    base = _slower(plan_for(None))
    everything = _fitting(plan_for, most, base)
    if everything is not None:
        return most, everything
    one = _fitting(plan_for, 1, base) if most > 1 else None
    if one is None:
        raise DoesNotFitError(_no_room(plan_for, base))
    low, best, high = 1, one, most - 1
    while low < high:
        middle = (low + high + 1) // 2
        candidate = _fitting(plan_for, middle, base)
        if candidate is None:
            high = middle - 1
        else:
            low, best = middle, candidate
    return low, best


def _slower(plan: Plan) -> tuple[int, int]:
    """Weight bytes off the GPUs, and on disk."""
    off = sum(u.bytes for u in plan.devices.values() if not is_gpu(u.key))
    return off, sum(u.bytes for u in plan.devices.values() if u.key == "disk")


def _fitting(plan_for: PlanFor, rows: int, base: tuple[int, int]) -> Plan | None:
    """The plan for `rows`, if it keeps no more weight bytes off the GPUs (and on disk) than `base` does."""
    try:
        candidate = plan_for(rows)
    except DoesNotFitError:
        return None
    off, disk = _slower(candidate)
    return candidate if off <= base[0] and disk <= base[1] else None


def _no_room(plan_for: PlanFor, base: tuple[int, int]) -> str:
    try:
        one = plan_for(1)
    except DoesNotFitError as exc:
        return f"no room for one row: {exc}"
    workload = one.workload
    tokens = workload.seq_len if workload is not None else 0
    runtime = sum(u.kv_cache_bytes + u.activation_bytes + u.other_bytes for u in one.devices.values())
    moved = _slower(one)[0] - base[0]
    return (f"one row of {tokens} tokens needs {format_bytes(runtime)} (KV cache and activations) beside the "
            f"weights, and {format_bytes(moved)} of weights would move off the GPUs to make room (budget "
            f"{one.budget.label()}); lower the prompt and new-token limits, or give it more memory")
