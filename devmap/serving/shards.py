"""Serving models split over N processes, one per GPU (`devmap serve --tensor-parallel N`): the engine core's process
is rank 0 of a torch.distributed group, and N - 1 shard processes (`shard_worker.py`) hold the other shards.

Every process must issue the same collectives in the same order. So rank 0 sends each call that runs a model to the
shard processes before it runs it itself, one call at a time under one lock (`ShardProcesses.lock`): a load (with the
serving plan rank 0 chose, so that every process plans the same batch), an unload, a batch's opening, each step with
its joiners, each release, each collect, the batch's end, a prompt's scores. The tokens need not travel: every
process has the same logits (gathered over the vocabulary) and so the same tokens, greedy or sampled from one seed,
and its batch holds the same rows. Requests are known to the shard processes by a number per batch.

A shard process that ends (killed, out of memory, a CUDA error) ends the service's models: rank 0 stops the other
shard processes and its own process (`on_failure`), whose API side then answers every request 503 with the reason,
as `/health` does. A shard process ends with the engine core's process (the kernel's parent-death signal). A call
that fails in one process in a way the others may not have (anything but devmap's refusals of the call's input:
`shard_worker.same_everywhere`) ends the split the same way, on rank 0 as in a shard process, which sends its reason
first: going on, the processes would disagree on which collective comes next, and hang or sum one step's numbers
into another's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping


from ..generation.continuous import ContinuousBatch, SlotRequest
from ..generation.sampling import Sampling
from ..generation.row_types import Score
from ..planning.planner import split_map
from .batch_run import ModelBatches
from .errors import EngineGone, ServiceError
from .limits import EngineLimits
from .registry import ModelRegistry
from .resident import ResidentModel
from .scheduler import BatchShape
from .shard_start import StartedShards
from .shard_worker import describe, join_group, same_everywhere

log = logging.getLogger("devmap.serving")

ENDING_SECONDS = 2.0  # how long a call failing on rank 0 waits for a shard process's end that may have caused it

class ShardProcesses:
    """Rank 0's side of the split: the N - 1 shard processes, a pipe to each, the lock that keeps every call in one
    order, and a watchdog that calls `on_failure(reason)` once if one of them ends."""

    def __init__(self, started: StartedShards, on_failure: Callable[[str], None]) -> None:
        self.size, self.lock, self.failure = started.size, threading.RLock(), None
        self._failing = threading.Lock()  # not `lock`: the call holding it may wait in a collective for the dead
        self._hearing, self._heard = threading.Lock(), {}  # why each ended shard process ended (`_ended`)
        self._pipes, self._replies, self._last_words = started.calls, started.replies, started.last_words
        self._processes = started.processes
        self._on_failure = on_failure
        try:
            join_group(0, self.size, started.address)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="devmap-shard-watchdog", daemon=True).start()

    def send(self, *message: Any) -> None:
        """Every shard process gets `message` (the caller holds `lock` and runs the same call next)."""
        if self.failure is not None:
            raise EngineGone(self.failure)
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send(message)
            except (OSError, EOFError):
                raise self._lost(rank) from None

    def agree(self, ready: bool, what: str) -> None:
        """After this process's part of `what` (`ready`: it went well), every shard process says how its part went;
        all go on (True sent to them) or none does (False sent, and a ServiceError naming the first that failed)."""
        failures = []
        for rank, replies in enumerate(self._replies, start=1):
            while not replies.poll(1.0):
                if self.failure is not None:
                    raise EngineGone(self.failure)
            try:
                ok, reason = replies.recv()
            except (OSError, EOFError):
                raise self._lost(rank) from None
            if not ok:
                failures.append(f"shard process {rank}: {reason}")
        go = ready and not failures
        self.send("go", go)
        if failures:
            raise ServiceError(f"{what} failed on {'; '.join(failures)}")

    @contextlib.contextmanager
    def mirrored(self, what: str) -> Iterator[None]:
        """Around rank 0's part of a call the shard processes run too: a failure here that they may not have met
        (`same_everywhere`) ends the split (`fail`)."""
        try:
            yield
        except Exception as exc:
            if self.failure is None and not same_everywhere(exc):
                # rank 0 may have failed hearing of a shard process's end (gloo's connection closes as it exits):
                # then that end is the reason
                sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes, start=1)}
                ended = wait(list(sentinels), timeout=ENDING_SECONDS)
                if ended:
                    self.fail(self._ended(sentinels[ended[0]]))
                else:
                    self.fail(f"{what} failed on rank 0 of {self.size}: {describe(exc)}; the models split over the "
                              "GPUs cannot go on; restart the service")
            if self.failure is not None:
                raise EngineGone(self.failure) from exc
            raise

    def fail(self, reason: str) -> None:
        """End the split: the shard processes are stopped, and `on_failure(reason)` is called (once)."""
        with self._failing:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("%s", reason)
        with self._hearing:  # no reaping beside `_ended`'s
            for process in self._processes:
                if process.is_alive():
                    process.kill()
        self._on_failure(reason)

    def close(self) -> None:
        """Stop the shard processes (their models freed with them)."""
        self.failure = self.failure or "the service is shutting down"
        for pipe in self._pipes:
            with contextlib.suppress(OSError, EOFError):
                pipe.send(("stop",))
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()

    def _lost(self, rank: int) -> EngineGone:
        """Shard process `rank`'s pipe broke: the split ends with its end as the reason (waited for up to
        `ENDING_SECONDS`: the pipe may break before the watchdog hears of the end)."""
        process = self._processes[rank - 1]
        if self.failure is None:
            if wait([process.sentinel], timeout=ENDING_SECONDS):
                self.fail(self._ended(rank))
            else:
                self.fail(f"shard process {rank} of {self.size} stopped answering: the models split over the GPUs "
                          "cannot run without it; restart the service")
        return EngineGone(self.failure or "")

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes, start=1)}
        ready = wait(list(sentinels))
        if self.failure is not None:  # closing
            return
        self.fail(self._ended(sentinels[ready[0]]))

    def _ended(self, rank: int) -> str:
        """Why the split ends, shard process `rank` having ended: its exit code and its last words, if it said any.
        Worked out once (the watchdog and a failed call may both ask: two joins at once can lose the exit code)."""
        with self._hearing:
            if rank not in self._heard:
                process, words = self._processes[rank - 1], self._last_words[rank - 1]
                process.join(5)
                said = ""
                with contextlib.suppress(OSError, EOFError):
                    said = f" ({words.recv()})" if words.poll(1.0) else ""
                self._heard[rank] = (f"shard process {rank} of {self.size} ended (exit code {process.exitcode}){said}: "
                                     "the models split over the GPUs cannot run without it; restart the service")
            return self._heard[rank]


class SplitRegistry(ModelRegistry):
    """Rank 0's registry: each load and unload goes to the shard processes too (a load with the serving plan this
    process chose and the budget it chose it in)."""

    def __init__(self, shards: ShardProcesses, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, tensor_parallel=shards.size, **kwargs)
        self.shards = shards

    def load(self, path: Path, model_id: str | None = None, device_map: Any = None,
             max_memory: str | Mapping[Any, Any] | None = None, dtype: str | None = None) -> ResidentModel:
        if device_map is not None:
            raise ServiceError(f"this service splits every model over {self.shards.size} GPUs, one shard on each: "
                               "leave device_map out", param="device_map")
        with self.shards.lock:  # the shard processes load in step (the warm-up's collectives)
            self._loading_id, self._awaiting, self._agreed = model_id or path.name, False, False
            try:
                return super().load(path, model_id, device_map, max_memory, dtype)
            except Exception as exc:
                if self._awaiting:  # this process failed before the shards' weights were agreed on: none goes on
                    self._awaiting = False
                    with contextlib.suppress(ServiceError):
                        self.shards.agree(False, f"loading {self._loading_id}")
                elif self._agreed:  # after: the shard processes may be in the warm-up's collectives
                    self.shards.fail(f"loading {self._loading_id} failed on rank 0 of {self.shards.size} after every "
                                     f"process had its weights: {describe(exc)}; restart the service")
                    raise EngineGone(self.shards.failure or "") from exc
                raise

    def _serving_plan(self, path: Path, device_map: Any, budget: Any, dtype: str | None) -> Any:
        serving = super()._serving_plan(path, device_map, budget, dtype)
        self.shards.send("load", str(path), self._loading_id, dtype, serving.rows, serving.cache_len, serving.lanes,
                         split_map(serving.plan), budget)
        self._awaiting = True
        return serving

    def _weights_loaded(self, model_id: str) -> None:
        """Every shard process has its weights too, or the load ends here on every process (none waits in the
        warm-up's collectives for one that failed)."""
        self._awaiting = False
        self.shards.agree(True, f"loading {model_id}")
        self._agreed = True

    def unload(self, model_id: str, drain: float = 0.0) -> None:
        super().unload(model_id, drain)  # waits for its batch's end (sent to the shards already)
        with self.shards.lock:
            self.shards.send("unload", model_id)


class SplitBatches(ModelBatches):
    """Rank 0's batches: each opening, step, release, collect and end goes to the shard processes first."""

    def __init__(self, limits: EngineLimits, shards: ShardProcesses) -> None:
        super().__init__(limits)
        self.shards = shards

    @contextlib.contextmanager
    def open(self, resident: ResidentModel, shape: BatchShape, sampling: Sampling,
             scores: int | None) -> Iterator[ContinuousBatch]:
        with self.shards.lock:
            self.shards.send("open", resident.id, shape, sampling, scores)
            opened = super().open(resident, shape, sampling, scores)
            with self.shards.mirrored("starting a batch"):
                batch = opened.__enter__()
        try:
            yield MirroredBatch(batch, self.shards)  # type: ignore[misc]
        finally:
            with self.shards.lock:
                with contextlib.suppress(EngineGone):
                    self.shards.send("end")
                with self.shards.mirrored("ending a batch"):
                    opened.__exit__(None, None, None)

    def prompt_scores(self, resident: ResidentModel, ids: list[int], top: int) -> list[Score | None]:
        with self.shards.lock:
            self.shards.send("scores", resident.id, ids, top)
            with self.shards.mirrored("scoring a prompt"):
                return super().prompt_scores(resident, ids, top)


class MirroredBatch:
    """Rank 0's continuous batch with every call that changes it sent to the shard processes first; the rest is the
    batch's own. Requests go to them as numbers (`_number`), one per request of the batch."""

    def __init__(self, batch: ContinuousBatch, shards: ShardProcesses) -> None:
        self._batch, self._shards = batch, shards
        self._numbers: dict[int, tuple[Any, int]] = {}  # id(owner): (owner, its number), owners kept alive

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def step(self, joining: list[SlotRequest] | None = None) -> bool:
        with self._shards.lock:
            self._shards.send("step", [(r.prompt, r.max_new_tokens, self._number(r.owner)) for r in joining or []])
            with self._shards.mirrored("a step"):
                return self._batch.step(joining)

    def release(self, owner: Any) -> None:
        with self._shards.lock:
            self._shards.send("release", self._number(owner))
            with self._shards.mirrored("releasing a row"):
                self._batch.release(owner)

    def collect(self, everything: bool = False, scored: bool = False) -> list[tuple]:
        with self._shards.lock:
            self._shards.send("collect", everything)
            with self._shards.mirrored("collecting tokens"):
                return self._batch.collect(everything, scored)

    def _number(self, owner: Any) -> int:
        known = self._numbers.get(id(owner))
        if known is None:
            known = self._numbers[id(owner)] = (owner, len(self._numbers))
        return known[1]
