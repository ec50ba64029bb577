"""torch.compile's private and experimental API, each use checked on the releases in `devmap.compat`'s table: the
recompile limit and stance, the backend behind a name, dynamo's compile totals, dynamic dimensions and duck shaping,
and entries compiled ahead of time (saved with their guards, loaded without tracing: `generation.region_store`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least `limit` compiled entries per function (its default of 8 is too few)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


@contextlib.contextmanager
def fail_on_recompile() -> Iterator[None]:
    """A compiled function whose guards fail raises instead of compiling (which a CUDA-graph capture cannot hold)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def compile_backend(name: str) -> Any:
    """The dynamo backend `torch.compile(backend=name)` would use (inductor's `compile_fx` for "inductor"), to call
    from a backend of devmap's own."""
    return torch._dynamo.lookup_backend(name)


def ahead_of_time_possible() -> bool:
    """Whether this torch compiles a function ahead of time into an entry it can save and load (`aot_compile`)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except ImportError:
        return False
    return all(hasattr(AOTCompiledFunction, name) for name in (
        "serialize", "deserialize", "guard_check", "disable_guard_check"))


def ahead_of_time(function: Any, backend: str, args: tuple[Any, ...]) -> Any:
    """`function` compiled whole (no graph break) by the backend named `backend` for calls like `function(*args)`
    (the dynamic marks on their tensors kept): one entry, its graph, guards and the backend's code together, called
    like `function`, without checking its guards (`entry_accepts` does that)."""
    config = torch._dynamo.config
    # torch 2.11 gives a compiled function its `aot_compile` only while this flag is set; 2.14 always does
    switch = (config.patch(enable_aot_compile=True) if hasattr(config, "enable_aot_compile")
              else contextlib.nullcontext())
    with switch:
        compiled = torch.compile(function, backend=backend, fullgraph=True)
    entry = compiled.aot_compile((args, {}))
    entry.disable_guard_check()
    return entry


@functools.cache
def ahead_of_time_keeps(backend: str) -> bool:
    """Whether an `ahead_of_time` entry of the backend named `backend` can be saved (tried once per process on a
    one-line function): torch 2.11 saves inductor's code only (a backend whose code is a plain function, aot_eager's,
    fails its bundled autograd cache: "expected OutputCode"); 2.14 saves aot_eager's too."""
    if not ahead_of_time_possible():
        return False
    try:
        entry_bytes(ahead_of_time(_plus_one, backend, (torch.zeros(2),)))
    except Exception:  # noqa: BLE001 - whatever the backend's code fails with, it cannot be kept
        return False
    return True


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def entry_bytes(entry: Any) -> bytes:
    """What an `ahead_of_time` entry saves as (its graph, guards and compiled code)."""
    return type(entry).serialize(entry).serialized_data


def entry_from_bytes(data: bytes, function: Any) -> Any:
    """The entry `entry_bytes` gave, loaded back for `function` (whose module's globals its code reads)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    entry = AOTCompiledFunction.deserialize(data, f_globals=function.__globals__)
    entry.disable_guard_check()
    return entry


def entry_accepts(entry: Any, args: tuple[Any, ...]) -> bool:
    """Whether the entry's guards accept a call with `args` (what dynamo would check before running it)."""
    return bool(entry.guard_check(*args))


class CompileTotals(NamedTuple):
    """What torch.compile has done in this process so far: seconds in dynamo's compiles (tracing, then inductor or
    its on-disk caches), graphs compiled, and how many of inductor's graphs came from its FX graph cache."""

    seconds: float
    graphs: int
    from_cache: int


def compile_totals() -> CompileTotals:
    """This process's compile totals so far (`torch._dynamo.utils.compilation_time_metrics` and `counters`: dynamo's
    own bookkeeping, process-wide, every thread's compiles together); a difference of two gives what ran between."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    return CompileTotals(seconds, int(counters["stats"]["unique_graphs"]),
                         int(counters["inductor"]["fxgraph_cache_hit"]))


def dynamic_dims(tensor: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Compile code that reads `tensor` for any size of `dims` (the others stay fixed): `maybe_mark_dynamic`'s mark,
    set directly on a plain tensor, without the work of its decorators at every call of a compiled region."""
    if type(tensor) not in (torch.Tensor, nn.Parameter):  # a subclass: dynamo marks its inner tensors too
        torch._dynamo.maybe_mark_dynamic(tensor, list(dims))
    else:
        tensor.__dict__.setdefault("_dynamo_weak_dynamic_indices", set()).update(dims)


@contextlib.contextmanager
def distinct_sizes() -> Iterator[None]:
    """A context in which a dynamic compile gives equal-sized dimensions symbols of their own (dynamo's "duck shaping"
    ties them, and specializing one, a KV head count, would specialize the other, the rows); set directly."""
    from torch.fx.experimental import _config

    before, _config.use_duck_shape = _config.use_duck_shape, False
    try:
        yield
    finally:
        _config.use_duck_shape = before
