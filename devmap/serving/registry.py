"""Resident models: loaded once onto their devices, found by id, unloaded on request or when idle.

Clients may only name directories under the model root (never an arbitrary path). Each load is planned for what
the service will run on it: its weights plus the KV cache and activations of its largest batch (the service's
`max_batch` rows, or as many as fit, each with a cache for the longest prompt and budget the limits allow;
`devmap.planning.rows_fit`). Each load gets what earlier resident models' plans left of the service's budget
(`max_memory`, else the machine's as the first load found it), so a model the service admits never runs out of
memory at its largest batch, and one that does not fit is refused (409) with the numbers.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from ..errors import DevmapError, DoesNotFitError
from ..planning.budget import resolve_budget
from ..planning.devices import DeviceKey
from .errors import DoesNotFit, ModelNotFound, ModelUnloading, ServiceError
from .limits import EngineLimits
from .interpreter_switch import switching_often
from .load_phases import CompiledGraphs, LoadPhases
from .prepare import prepare_for_serving
from .resident import ResidentModel
from .step_compile import StepCompile

if TYPE_CHECKING:
    from .load_plan import ServingPlan

log = logging.getLogger("devmap.serving")

UNLOAD_GRACE = 60.0  # seconds an unload waits past its drain bound for the step in flight (a cold compile's)


class ModelRegistry:
    """The resident models of one service. Thread-safe; loads run one at a time."""

    def __init__(self, model_root: str | Path | None = None, device_map: Any = "balanced",
                 max_memory: str | Mapping[Any, Any] | None = None, dtype: str | None = None,
                 quantization: Any = None, limits: EngineLimits | None = None, random_weights: bool = False,
                 tensor_parallel: int = 1) -> None:
        self.root = Path(model_root).expanduser().resolve() if model_root is not None else None
        # > 1: this process holds one shard of each model, split over that many processes (`serving.shards`)
        self.tensor_parallel = tensor_parallel
        self.device_map, self.dtype, self.quantization = device_map, dtype, quantization
        self.random_weights = random_weights  # every load made of random weights on its devices (`loader.load`)
        self.limits = limits or EngineLimits()  # the batches its models must have room for
        self.budget = dict(resolve_budget(max_memory).limits) if max_memory is not None else {}
        self._machine: dict[DeviceKey, int] = {}  # without a service budget: the machine's, as the first load found it
        self._models: dict[str, ResidentModel] = {}
        self._lock = threading.Lock()
        self._loading = threading.Lock()

    def under_root(self, name: str) -> Path:
        """The directory a client named, which must lie under the model root (symlinks resolved)."""
        if self.root is None:
            raise ServiceError("this service was started without --model-root: it loads no models on request",
                               param="model")
        relative = Path(name)
        if not name or relative.is_absolute() or ".." in relative.parts:
            raise ServiceError(f"model {name!r} must be a directory name under the model root, not a path",
                               param="model")
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root) or not path.is_dir():
            raise ModelNotFound(f"no model directory {name!r} under the model root", param="model")
        return path

    def load(self, path: Path, model_id: str | None = None, device_map: Any = None,
             max_memory: str | Mapping[Any, Any] | None = None, dtype: str | None = None) -> ResidentModel:
        """Load the directory onto its devices (within what the budget has left) and make it resident, its LLaMA
        layers' input projections joined (`generation.joined_projections`: two products where transformers runs
        five per decode step)."""
        model_id = model_id or path.name
        with self._loading:
            with self._lock:
                if model_id in self._models:
                    raise ServiceError(f"model {model_id!r} is already loaded; unload it first or pick another id",
                                       param="id")
            with switching_often():  # other models' streams get the interpreter back within microseconds
                return self._load(path, model_id, device_map, max_memory, dtype)

    def _load(self, path: Path, model_id: str, device_map: Any, max_memory: str | Mapping[Any, Any] | None,
              dtype: str | None) -> ResidentModel:
        """`load`'s work, one load at a time (`_loading` held)."""
        from ..loading.loader import load

        budget = self._load_budget(max_memory)
        phases = LoadPhases()
        try:
            with phases.timed("plan"):
                serving = self._serving_plan(path, device_map or self.device_map, budget, dtype or self.dtype)
            with phases.timed("weights"):
                model = load(str(path), plan=serving.plan, random_weights=self.random_weights)
        except DoesNotFitError as exc:
            raise DoesNotFit(f"{model_id} does not fit in what the service's budget has left: {exc}") from None
        except DevmapError as exc:
            raise ServiceError(f"cannot load {model_id}: {exc}") from None
        try:
            self._weights_loaded(model_id)
            # a whole model may compile while it serves (--compile-beside, or its first start: compiles_beside); a
            # split's processes compile in step before serving (the warm-up's collectives)
            ready = prepare_for_serving(model, path, model_id, self.limits, serving.rows, phases,
                                        compile_beside=self.limits.compile_beside if self.tensor_parallel == 1
                                        else False,
                                        lanes=serving.lanes)
        except BaseException:
            _free(model)
            raise
        log.info("%s loaded: %s", model_id, phases.summary())
        report = model.devmap_load_report.to_dict()
        split = model.devmap_plan.tensor_parallel
        vocab = model.get_input_embeddings().num_embeddings * (split.size if split and split.vocab else 1)
        resident = ResidentModel(
            id=model_id, path=path, model=model, tokenizer=ready.tokenizer, created=int(time.time()),
            context=ready.context, vocab_size=vocab,
            planned=_planned(model.devmap_plan),
            report=report, max_rows=serving.rows, cache_len=serving.cache_len, lanes=serving.lanes,
            compiled=ready.compiled, eos_ids=ready.eos_ids, load_seconds=phases.seconds,
            compiled_graphs=phases.graphs, warm_key=ready.warm_key, kept_shapes=ready.served,
        )
        if ready.served is not None:  # its warm-up made the steps of the batch it served at when it last ran
            resident.batch_shape = ready.served.batch
        self.add(resident)
        _freeze_survivors()
        if ready.compile_later:
            self._compile_beside(resident)
        return resident

    def _compile_beside(self, resident: ResidentModel) -> None:
        """Compile the model's steps while it serves (`step_compile`): in a process of its own where it can
        (`compile_process`), then loaded here by a light warm-up; its batches move to them once ready."""
        from .compile_cache import compiled_anew
        from .compile_process import compile_elsewhere, job_for
        from .warm_up import WarmUpTimes, warm_up

        model, rows, context, riding = resident.model, resident.max_rows, resident.context, self.limits.riding
        made = job_for(model, resident.path, rows, context, riding, resident.warm_key, resident.kv_room,
                       [(other.model, other.kv_room) for other in self.all() if other is not resident])
        job = None
        if isinstance(made, str):
            log.info("%s: its steps compile in the serving process: %s", resident.id, made)
        else:
            job = made

        def compile(stop: Callable[[], bool]) -> WarmUpTimes:
            # where the compile's process fails, the warm-up here compiles what it did not keep
            elsewhere = (compile_elsewhere(job, stop) if job is not None else None) or 0.0
            if stop():  # the model is being unloaded: nothing more to compile (`done` is not called)
                return WarmUpTimes(elsewhere, 0.0, 0.0, CompiledGraphs(0, 0))
            times = compiled_anew(lambda: warm_up(model, rows, context, riding, beside_serving=True, stop=stop,
                                                  after_whole_pass=elsewhere > 0))
            return times._replace(compile=times.compile + elsewhere)  # its compile phase: there, then loaded here

        def done(times: WarmUpTimes) -> None:
            for phase, seconds in times.phases().items():  # the eager steps' warm-up before it answered, added
                resident.load_seconds[phase] = resident.load_seconds.get(phase, 0.0) + seconds
            resident.compiled_graphs = times.graphs
            resident.compiled = True
            _freeze_survivors()  # what the compile made and keeps, left out of later collections too

        resident.compiling = StepCompile(resident.id, compile, done)

    def add(self, resident: ResidentModel) -> None:
        """Make a model resident (one `load` made, or a caller's own) under its id."""
        with self._lock:
            if resident.id in self._models:
                raise ServiceError(f"model {resident.id!r} is already loaded; unload it first or pick another id",
                                   param="id")
            self._models[resident.id] = resident

    def _load_budget(self, max_memory: str | Mapping[Any, Any] | None) -> Any:
        """What a load may use: the request's `max_memory`, else what the service's budget (or the machine's, read at
        the first load with nothing of ours on it) has left."""
        if max_memory is None and not self.budget and not self.all():
            self._machine = dict(resolve_budget().limits)
        return max_memory if max_memory is not None else self.remaining()

    def _weights_loaded(self, model_id: str) -> None:
        """Between a load's weights and its preparing (compiling, warming up): nothing here (a split registry agrees
        with its shard processes that every one has its weights, before their warm-ups meet in collectives)."""

    def _serving_plan(self, path: Path, device_map: Any, budget: Any, dtype: str | None) -> ServingPlan:
        """The largest batch the model will run within `budget`: its rows, lanes, cache tokens per row, and plan."""
        from ..planning.models import resolve_source
        from ..planning.planner import plan_shard, planner
        from .load_plan import plan_serving

        source = resolve_source(str(path))  # its config read once for every plan below
        if self.tensor_parallel > 1:  # this process's shard (rank 0's): its GPU of each group of the split
            return plan_serving(source, self.limits, lambda workload: plan_shard(
                source, self.tensor_parallel, 0, budget, dtype, workload))
        return plan_serving(source, self.limits, planner(source, device_map, budget, dtype,
                                                         quantization=self.quantization))

    def planned(self) -> dict[DeviceKey, int]:
        """What the resident models' plans hold on each device at their largest batches."""
        total: dict[DeviceKey, int] = {}
        with self._lock:
            for resident in self._models.values():
                for key, size in resident.planned.items():
                    total[key] = total.get(key, 0) + size
        return total

    def remaining(self) -> dict[Any, int] | None:
        """The service budget (or the machine's, as the first load found it) less what resident models planned on
        each device (None before any load without a service budget: the planner then reads the machine)."""
        if not self.budget and not self._machine:
            return None
        left = dict(self.budget or self._machine)
        with self._lock:
            for resident in self._models.values():
                for key, size in resident.planned.items():
                    if key in left:
                        left[key] = max(left[key] - size, 0)
        return left

    def get(self, model_id: str) -> ResidentModel:
        """The resident model for new work (404 if none, 503 while it is being unloaded)."""
        resident = self.serving(model_id)
        if resident.unload_at is not None:
            raise ModelUnloading(f"model {model_id!r} is being unloaded and takes no new requests", param="model")
        return resident

    def serving(self, model_id: str) -> ResidentModel:
        """The resident model for requests it took before an unload began, until the unload's drain bound."""
        with self._lock:
            resident = self._models.get(model_id)
        if resident is None:
            raise ModelNotFound(f"model {model_id!r} is not loaded; GET /v1/models lists the loaded ones",
                                param="model")
        if resident.drained():
            raise ModelUnloading(f"model {model_id!r} was unloaded before this request started", param="model")
        return resident

    def all(self) -> list[ResidentModel]:
        with self._lock:
            return list(self._models.values())

    def unload(self, model_id: str, drain: float = 0.0) -> None:
        """Drop the model and free its device memory: from now on it takes no new requests (503), those it took may
        run for up to `drain` seconds (the engine ends the rest then), and this returns once none runs."""
        with self._lock:
            resident = self._models.get(model_id)
            if resident is None:
                raise ModelNotFound(f"model {model_id!r} is not loaded; GET /v1/models lists the loaded ones",
                                    param="model")
            if resident.unload_at is None:  # a second unload keeps the first one's bound
                resident.unload_at = time.monotonic() + drain
            wait = max(resident.unload_at - time.monotonic(), 0.0) + UNLOAD_GRACE
        if resident.compiling is not None:  # a compile beside its serving ends at its next step
            resident.compiling.stop()
        if not resident.busy.acquire(timeout=wait):  # the engine ends its batch at its next step past the bound
            raise ServiceError(f"model {model_id!r} is still running a step {UNLOAD_GRACE:g} s past its drain bound; "
                               "it takes no new requests, try the unload again")
        try:
            with self._lock:
                if self._models.get(model_id) is not resident:  # another unload freed it meanwhile
                    return
                del self._models[model_id]
            _free(resident.model)
        finally:
            resident.busy.release()
        del resident
        gc.unfreeze()  # the model's objects were frozen at its load: cycles among them are garbage only now
        _freeze_survivors()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def idle(self, seconds: float) -> list[str]:
        """Ids of models unused for more than `seconds`."""
        now = time.monotonic()
        return [r.id for r in self.all() if now - r.last_used > seconds and not r.busy.locked()]


def _free(model: nn.Module) -> None:
    """Release the model's tensors and captured graphs now (not whenever the last reference goes)."""
    from ..generation.step_cache import release_graphs

    release_graphs(model)
    for module in model.modules():
        for key in list(module._parameters):
            module._parameters[key] = None
        for key in list(module._buffers):
            module._buffers[key] = None


def _freeze_survivors() -> None:
    """Collect, then exclude every object alive now (models, their modules and tensors, the server's own) from
    Python's later collections: a full collection otherwise walks them all, holding every thread (the engine's
    issuing thread too) for a noticeable pause in the middle of a burst of requests. Unload unfreezes."""
    gc.collect()
    gc.freeze()


def _planned(plan: Any) -> dict[DeviceKey, int]:
    """What a resident model's plan holds on each device at its largest batch; a split's on every GPU of each of its
    groups (each holds what this process's GPU of the group holds), so that the service's budget and `/metrics` count
    the shard processes' GPUs too."""
    split = plan.tensor_parallel
    planned: dict[DeviceKey, int] = {}
    for usage in plan.devices.values():
        members = split.group_of(usage.key) if split and isinstance(usage.key, int) else (usage.key,)
        for key in members:
            planned[key] = usage.total
    return planned

