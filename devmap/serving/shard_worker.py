"""A shard process of a split service (`serving.shards`): rank r of the group, holding its own shard of every model
the engine core loads, repeating in order every call rank 0 sends (loads with rank 0's serving plan, batches and
their steps, releases and collects, prompt scores). It answers nothing: every process computes the same tokens, and
rank 0 hands them out. It ends when rank 0 says stop, when its pipe closes, or with the engine core's process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import DevmapError
from ..generation.continuous import SlotRequest
from ..generation.row_types import StepFailed
from .batch_run import ModelBatches
from .errors import ServiceError
from .limits import EngineLimits
from .load_plan import ServingPlan, serving_workload
from .registry import ModelRegistry

log = logging.getLogger("devmap.serving")

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waiting this long for a process gives up (a first compile's)


class Owner:
    """A request of rank 0's batch, as a shard process knows it: by its number in the batch."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class LoadCalledOff(Exception):
    """Rank 0 or another shard process failed to load its weights: this process's load ends too."""


class Diverged(Exception):
    """A load failed here after every process had its weights (in its warm-up's collectives, say): the others may
    have gone on, so the split cannot."""


def same_everywhere(exc: BaseException) -> bool:
    """Whether every process of the split fails this call this way, at the same point: devmap's refusals of the call's
    input, which every process was given alike. Any other failure (out of memory, a CUDA error) may be one process's
    alone, after some of the call's collectives and before others: the processes would no longer agree on which
    collective comes next (a hang, or one step's sums added into another step's)."""
    cause = exc.cause if isinstance(exc, StepFailed) else exc
    return isinstance(cause, (DevmapError, ServiceError)) and not isinstance(exc, Diverged)


def describe(exc: BaseException) -> str:
    """"RuntimeError: CUDA out of memory ..." (its first line), the cause of a failed step's."""
    cause = exc.cause if isinstance(exc, StepFailed) else exc
    text = str(cause).splitlines()[0] if str(cause) else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


class RankZeroLoad(NamedTuple):
    """What rank 0 chose for a load, which every shard process plans with: the batch, the stages and the budget."""

    rows: int
    cache_len: int
    lanes: int
    stages: dict[str, Any]
    budget: Any


class ShardRegistry(ModelRegistry):
    """A shard process's registry: each model planned with the rows, cache length, lanes and stages rank 0 chose, in
    the budget rank 0 chose them in (its reading of every GPU: this process reading the machine itself would see
    rank 0's GPUs filling with its weights, and plan the split as not fitting); between its weights and its
    warm-up, every process agrees that all have their weights (`ShardProcesses.agree`)."""

    given = RankZeroLoad(1, 1, 1, {}, None)
    rank: int
    inbox: Connection
    replies: Connection

    def load_as(self, path: str, model_id: str, dtype: str | None, rows: int, cache_len: int, lanes: int,
                stages: dict[str, Any], budget: Any) -> None:
        self.given, self._answered = RankZeroLoad(rows, cache_len, lanes, stages, budget), False
        try:
            self.load(Path(path), model_id, dtype=dtype)
        except LoadCalledOff:
            pass
        except Exception as exc:
            if self._answered:  # every process has its weights, and the others may be in the warm-up's collectives
                raise Diverged(f"loading {model_id}: {describe(exc)}") from exc
            # failed before its weights were in place: say so and hear the outcome (no process goes on; rank 0
            # answers the load with every process's reason)
            self.replies.send((False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            self._outcome()
            log.debug("loading %s failed here before every process had its weights", model_id, exc_info=exc)

    def _load_budget(self, max_memory: Any) -> Any:
        return self.given.budget

    def _weights_loaded(self, model_id: str) -> None:
        self._answered = True
        self.replies.send((True, None))
        if not self._outcome():
            raise LoadCalledOff(model_id)

    def _outcome(self) -> bool:
        """Rank 0's word on whether every process goes on with the load."""
        message = self.inbox.recv()
        if message[0] != "go":
            raise RuntimeError(f"the shard process expected rank 0's word on a load, got {message[0]!r}")
        return bool(message[1])

    def _serving_plan(self, path: Path, device_map: Any, budget: Any, dtype: str | None) -> ServingPlan:
        from ..planning.models import resolve_source
        from ..planning.planner import plan_shard

        given = self.given
        context = int(getattr(resolve_source(str(path)).config, "max_position_embeddings", 0) or 0)
        plan = plan_shard(str(path), self.tensor_parallel, self.rank, budget, dtype,
                          serving_workload(context, given.rows, given.cache_len, given.lanes), stages=given.stages)
        return ServingPlan(given.rows, given.cache_len, plan, given.lanes)


def run_shard(rank: int, size: int, address: str, settings: Any, limits: EngineLimits, log_level: str,
              inbox: Connection, replies: Connection, last_words: Connection) -> None:
    """The shard process of `rank`: join the group, then repeat rank 0's calls until it says stop. A call that fails
    here as it may not have elsewhere (`same_everywhere`) ends this process, its reason sent on `last_words` first:
    rank 0 then ends the split's models with that reason, where going on would hang or mix up the collectives."""
    _end_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    logging.basicConfig(format=f"%(levelname)s:     %(name)s [shard {rank}]: %(message)s")
    logging.getLogger("devmap").setLevel(log_level.upper())
    join_group(rank, size, address)
    registry = ShardRegistry(settings.model_root, settings.device_map, settings.max_memory, settings.dtype,
                             quantization=settings.quantization, limits=limits,
                             random_weights=settings.random_weights, tensor_parallel=size)
    registry.inbox, registry.replies, registry.rank = inbox, replies, rank
    batches = ModelBatches(limits)
    opened: Any = None
    batch: Any = None
    owners: dict[int, Owner] = {}
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):
            break
        kind, args = message[0], message[1:]
        if kind == "stop":
            break
        try:
            if kind == "load":
                registry.load_as(*args)
            elif kind == "unload":
                registry.unload(args[0])
            elif kind == "open":
                model_id, shape, sampling, scores = args
                opened = batches.open(registry.serving(model_id), shape, sampling, scores)
                batch, owners = opened.__enter__(), {}
            elif kind == "step":
                batch.step([SlotRequest(prompt, new, owners.setdefault(n, Owner(n))) for prompt, new, n in args[0]])
            elif kind == "release":
                batch.release(owners.setdefault(args[0], Owner(args[0])))
            elif kind == "collect":
                batch.collect(everything=args[0])
                batch.busy()  # the busy clock's windows, which nobody reads here, let go
            elif kind == "end" and opened is not None:
                finished, opened, batch = opened, None, None
                finished.__exit__(None, None, None)
            elif kind == "scores":
                batches.prompt_scores(registry.serving(args[0]), args[1], args[2])
        except Exception as exc:  # noqa: BLE001 - answered by rank 0, or the end of this process
            if same_everywhere(exc):  # rank 0 met the same failure in the same call, and answers it
                log.debug("%s failed here as on rank 0", kind, exc_info=True)
                continue
            reason = describe(exc)
            log.error("%s failed in shard process %d: %s; it ends, and the split's models with it", kind, rank, reason,
                      exc_info=exc)
            with contextlib.suppress(OSError, EOFError):
                last_words.send(f"its {kind} call failed: {reason}")
            logging.shutdown()
            os._exit(1)
    if opened is not None:
        with contextlib.suppress(Exception):
            opened.__exit__(None, None, None)
    logging.shutdown()
    # no destroy_process_group: after CUDA graphs captured NCCL collectives it can hang (pytorch#115388)
    os._exit(0)


def join_group(rank: int, size: int, address: str) -> None:
    """Join the split's process group (NCCL on GPUs, gloo on CPUs), this process on the GPU of its rank."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        # NVLink multicast (NVLS) stays off unless asked for: on GPUs shared with other jobs a program using it can put
        # them out of service; devmap's all-reduces are small
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=address, rank=rank, world_size=size, timeout=GROUP_TIMEOUT,
                                device_id=torch.device("cuda", rank))
        from ..loading.tensor_shards import open_stage_groups

        open_stage_groups(size)  # the later pipeline stages' groups, before any load
    else:
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)


def _end_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the engine core's process) ends, however it ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
