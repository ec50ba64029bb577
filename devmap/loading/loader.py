"""`devmap.load` and `devmap.dispatch`: a model's blocks placed on the devices its plan chose, ready to run.

Outputs come back on the device the input came from (accelerate's hooks, as transformers does); inputs may
arrive on any device. Blocks on "cpu" while GPUs are in the map, and blocks on "disk", are offloaded: their
weights stay there and visit the first GPU for each forward (inference only). Everything else trains:
backward runs through the blocks on their devices.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import torch
from torch import nn

from ..planning import hardware
from ..planning.budget import resolve_budget
from .checkpoint import TensorEntry, index_checkpoint, match_state
from ..errors import UsageError
from .disk_offload import Deferred, offload_deferred, set_tensor, undo_offload_on_failure
from .file_maps import FileMaps
from .initialization import init_module_
from ..planning.devices import DeviceKey, device_label, is_gpu, torch_device
from ..planning.memory import Size, dtype_name, parse_dtype
from ..planning.models import resolve_source
from ..planning.device_maps import DeviceMapSpec, owner_of
from ..planning.planner import Plan, check_could_fit, plan_model
from ..planning.quantization import quantized_weights, resolve_quantization
from ..planning.workload import Workload
from ..compat import stored_tensors
from .device_hooks import attach_hooks
from .load_report import DeviceLoad, LoadReport
from .quantize import check_runnable, load_quantized
from .transfer import CopyJob, copy_into


def load(
    source: Union[str, Path],
    device_map: DeviceMapSpec = "auto",
    max_memory: str | Mapping[DeviceKey, Size] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_folder: str | Path | None = None,
    weights: str | Path | None = None,
    *,
    allow_missing: bool = False,
    allow_pickle: bool = False,
    no_split_module_classes: list[str] | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    quantization: Any = None,
    workload: Workload | None = None,
    random_weights: bool = False,
    plan: Plan | None = None,
    tensor_parallel: int = 1,
) -> nn.Module:
    """Load `source` (a local HF directory, a directory `devmap save` wrote, or a preset) onto its planned devices.

    Weights go from safetensors straight to their device; the model is never built on the CPU first.
    Presets without `weights` are randomly initialized on their devices. The returned model carries
    `hf_device_map`, `devmap_plan` (the Plan) and `devmap_load_report` (a LoadReport). `quantization` ("int8",
    "int4", "nf4", "fp8" or a transformers BitsAndBytesConfig) quantizes the blocks' Linear layers block by block as
    they arrive on their devices (devmap.loading.quantize); the dtype then defaults to bfloat16. `workload`
    (devmap.planning.workload) plans room for what the model will run, and refuses, before anything is read, a
    load whose workload would not fit. `random_weights` reads no weights: every tensor is initialized randomly
    (seeded) on its device, as for a preset, from the directory's config alone (vLLM's `--load-format dummy`: to
    measure a model whose weights are not at hand; a directory `devmap save --config-only` wrote has no others).
    `plan`, a finished `devmap.plan(source, ...)`, is loaded as it is (its map, dtype, quantization and workload),
    without planning again; the options it already settled are then left out. `tensor_parallel` N > 1 loads this
    process's shard of a LLaMA-family model split over N processes (started by torchrun): each holds 1/N of every
    attention and MLP block and runs with the others (`devmap.loading.tensor_shards`); on a multiple of N GPUs the
    groups of N are pipeline stages, and each process holds its GPU of every group.
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise UsageError(f"invalid tensor_parallel={tensor_parallel!r}: it must be a positive integer")
    if tensor_parallel > 1 or (plan is not None and plan.tensor_parallel is not None):
        return _load_shard(source, tensor_parallel, plan, device_map, max_memory, dtype, offload_folder, weights,
                           allow_missing, no_split_module_classes, quantization, workload, random_weights,
                           allow_pickle, seed, workers, progress)
    start = time.perf_counter()
    cuda_init = hardware.start_gpus_in_background()  # contexts start while transformers' classes import
    model_source = resolve_source(source)
    if cuda_init is not None:
        cuda_init.join()
    if model_source.kind == "module":
        raise UsageError("load takes a preset or a local directory; for a model you built, use devmap.dispatch")
    if plan is not None:
        _check_plan_alone(plan, model_source.name, device_map, max_memory, dtype, quantization, workload,
                          no_split_module_classes)
        quantized, torch_dtype = plan.quantization, plan.dtype
    else:
        quantized, torch_dtype = resolve_quantization(quantization, parse_dtype(dtype), model_source)
    if random_weights and weights is not None:
        raise UsageError("random_weights reads no weights: drop weights, or random_weights")
    checkpoint = None if random_weights else Path(weights).expanduser() if weights is not None else model_source.path
    entries = index_checkpoint(checkpoint, allow_pickle) if checkpoint is not None else None
    folder = str(offload_folder) if offload_folder is not None else None
    model = model_source.build(cpu_buffers=True)
    if plan is None:
        budget = resolve_budget(max_memory, offload_folder=folder)
        check_could_fit(model_source, budget, torch_dtype, quantized)
        plan = plan_model(model, model_source, device_map, budget, torch_dtype, no_split_module_classes, quantized,
                          workload)
    shrink = set(quantized_weights(model, quantized)) if quantized is not None else set()
    if quantized is not None:
        owners = (owner_of(name, plan.device_map) for name in shrink)
        check_runnable(quantized, {plan.device_map[owner] for owner in owners if owner is not None})
    with undo_offload_on_failure(folder):
        _check_devices(plan, folder)
        from accelerate.utils import find_tied_parameters

        state = model.state_dict(keep_vars=True)
        expected = {n: tuple(t.shape) for n, t in state.items()}
        floating = {n for n, t in state.items() if t.is_floating_point()}
        missing = (match_state(expected, entries, find_tied_parameters(model), allow_missing, floating)
                   if entries is not None else list(expected))
        std = float(getattr(model_source.config, "initializer_range", 0.02) or 0.02)
        try:
            report = _materialize(model, plan, entries or {}, set(missing), std, seed, folder, workers, progress,
                                  shrink)
            attach_hooks(model, plan, folder)
        except BaseException:
            _release(model)
            raise
    report.update(source=model_source.name, checkpoint=str(checkpoint) if checkpoint else None,
                  random_init=entries is None, initialized=sorted(missing) if entries is not None else [],
                  seconds=time.perf_counter() - start)
    model.eval()
    model.devmap_load_report = LoadReport(dtype=dtype_name(torch_dtype), offload_folder=folder, **report)
    return model


def _load_shard(source: Any, size: int, plan: Plan | None, device_map: Any, max_memory: Any, dtype: Any,
                offload_folder: Any, weights: Any, allow_missing: bool, no_split: Any, quantization: Any, workload: Any,
                random_weights: bool, allow_pickle: bool, seed: int, workers: int | None,
                progress: Callable[[int], None] | None) -> nn.Module:
    """`load` with tensor parallelism: the options that place whole blocks are refused, then `load_shard`."""
    from .tensor_shards import load_shard

    if plan is not None:
        split = plan.tensor_parallel
        gpus = [usage.key for usage in plan.devices.values() if isinstance(usage.key, int)]
        if split is None or len({split.group_of(g) for g in gpus}) != len(gpus):  # a shard holds one GPU a group
            raise UsageError("a plan of whole blocks or of every GPU of a split cannot load one process's shard: "
                             "give tensor_parallel=N alone, or a shard's plan (devmap.planning.planner.plan_shard)")
        if size not in (1, split.size):
            raise UsageError(f"the plan splits the model {split.size} ways, not tensor_parallel={size}")
        size = split.size
    placing = [name for name, value, default in (
        ("device_map", device_map, "auto"), ("max_memory", max_memory, None), ("offload_folder", offload_folder, None),
        ("quantization", quantization, None), ("no_split_module_classes", no_split, None),
        ("allow_missing", allow_missing, False), ("dtype", dtype if plan is not None else None, None),
        ("workload", workload if plan is not None else None, None)) if value != default]
    if placing:
        raise UsageError(f"tensor_parallel={size} plans each process's shard itself (its GPU of each group of {size}, "
                         f"the groups the pipeline's stages): leave out "
                         f"{', '.join(placing)}")
    model_source = resolve_source(source)
    if model_source.kind == "module":
        raise UsageError("load takes a preset or a local directory; for a model you built, use devmap.dispatch")
    if random_weights and weights is not None:
        raise UsageError("random_weights reads no weights: drop weights, or random_weights")
    checkpoint = None if random_weights else Path(weights).expanduser() if weights is not None else model_source.path
    torch_dtype = parse_dtype(dtype) or model_source.default_dtype
    return load_shard(model_source, size, torch_dtype, checkpoint, plan=plan, workload=workload,
                      allow_pickle=allow_pickle, seed=seed, workers=workers, progress=progress)


def dispatch(
    model: nn.Module,
    device_map: DeviceMapSpec = "auto",
    max_memory: str | Mapping[DeviceKey, Size] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_folder: str | Path | None = None,
    no_split_module_classes: list[str] | None = None,
) -> nn.Module:
    """Place a model you built (with its own weights, on the CPU) on devices by a strategy or an explicit map."""
    model_source = resolve_source(model)
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is not None:
        model.to(torch_dtype)
    folder = str(offload_folder) if offload_folder is not None else None
    budget = resolve_budget(max_memory, offload_folder=folder)
    plan = plan_model(model, model_source, device_map, budget, torch_dtype or model_source.default_dtype,
                      no_split_module_classes)
    with undo_offload_on_failure(folder):
        _check_devices(plan, folder)
        attach_hooks(model, plan, folder)
    return model


def _check_plan_alone(plan: Plan, source: str, device_map: Any, max_memory: Any, dtype: Any, quantization: Any,
                      workload: Any, no_split: Any) -> None:
    """A finished plan is loaded as it is: refuse one made for another model, or options it already settled."""
    if plan.source != source:
        raise UsageError(f"the plan was made for {plan.source}, not {source}: plan this source, or load the plan's")
    given = [name for name, value, default in (("device_map", device_map, "auto"), ("max_memory", max_memory, None),
                                               ("dtype", dtype, None), ("quantization", quantization, None),
                                               ("workload", workload, None), ("no_split_module_classes", no_split,
                                                                              None)) if value != default]
    if given:
        raise UsageError(f"a finished plan already settles {', '.join(given)}: leave them out, or plan again with them")


def _check_devices(plan: Plan, folder: str | None) -> None:
    """Real devices only, and a writable offload folder when the plan uses disk; all before any byte moves."""
    count = hardware.gpu_count()
    for device in set(plan.device_map.values()):
        if is_gpu(device) and device >= count:
            raise UsageError(
                f"the plan puts blocks on {device_label(device)}, but {count} GPU(s) are visible; "
                "lower --max-memory to the devices you have"
            )
    if "disk" in plan.device_map.values():
        if folder is None:
            raise UsageError("the plan offloads blocks to disk: pass --offload-folder DIR (offload_folder=...)")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        except OSError as exc:
            raise UsageError(f"offload folder {folder} can't be written ({exc.strerror or exc}); "
                             "choose another") from None


def _target(plan: Plan, name: str) -> DeviceKey:
    return plan.device_map[owner_of(name, plan.device_map)]


def _materialize(
    model: nn.Module, plan: Plan, entries: dict[str, TensorEntry], missing: set[str], std: float, seed: int,
    folder: str | None, workers: int | None, progress: Callable[[int], None] | None, shrink: set[str] = frozenset(),
) -> dict[str, Any]:
    """Allocate every tensor on its device, initialize what the checkpoint lacks, copy the rest, offload disk;
    the weights named in `shrink` come last, block by block, and are quantized as each block lands."""
    gpus = sorted({d for d in plan.device_map.values() if is_gpu(d)})
    before = {g: torch.cuda.memory_allocated(g) for g in gpus}
    aliases = {n: a for group in _tied_groups(model) for n in group for a in group if a in entries}
    persistent = set(model.state_dict(keep_vars=True))
    made: dict[int, torch.Tensor] = {}
    jobs: list[CopyJob] = []
    deferred: dict[int, Deferred] = {}
    to_init: dict[str, torch.device] = {}
    later: dict[str, tuple[torch.device, TensorEntry | None]] = {}  # quantized weights, block by block
    maps, mapped_bytes = FileMaps(), 0
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        key = _target(plan, name)
        device = torch_device(key, disk_as_cpu=True)  # disk blocks are made in host memory, then written
        if id(tensor) in deferred:  # a tied alias of a parameter bound for disk: its own index entry
            deferred[id(tensor)].aliases.append(name)
            continue
        if id(tensor) in made:  # a tied alias: the same tensor
            set_tensor(model, name, made[id(tensor)])
            continue
        floating = tensor.is_floating_point() and name in persistent
        dtype = plan.dtype if floating else tensor.dtype
        entry = entries.get(name) or entries.get(aliases.get(name, ""))
        needs_init = entry is None and (tensor.device.type == "meta" or name in missing)
        if name in shrink:
            later[name] = (device, entry)
            continue
        if key == "disk" and isinstance(tensor, nn.Parameter):  # buffers stay in memory (accelerate moves them)
            deferred[id(tensor)] = Deferred(name, tuple(tensor.shape), dtype, tensor.requires_grad, entry, needs_init)
            continue
        mapped = maps.view(entry) if entry is not None and key == "cpu" and dtype == entry.dtype else None
        if mapped is not None:  # host memory in the stored dtype: the file's own bytes, no copy
            value = mapped
            mapped_bytes += entry.nbytes
            if progress is not None:
                progress(entry.nbytes)
        elif tensor.device.type == "meta" or entry is not None:
            value = torch.empty(tensor.shape, dtype=dtype, device=device)
        else:
            value = tensor.to(device)  # a buffer the constructor computed (e.g. rotary inv_freq)
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        made[id(tensor)] = value
        set_tensor(model, name, value)
        if needs_init:
            to_init[name.rpartition(".")[0]] = device
        if entry is not None and mapped is None:
            jobs.append(CopyJob(entry, value.data))
    generators: dict[torch.device, torch.Generator] = {}
    for module_name, device in to_init.items():
        generator = generators.setdefault(device, torch.Generator(device=device).manual_seed(seed))
        init_module_(model.get_submodule(module_name), std=std, generator=generator)
    finished = copy_into(jobs, workers=workers, progress=progress)
    if later:
        load_quantized(model, plan, later, std, seed, workers, progress)
    if deferred:
        finished["disk"] = offload_deferred(model, list(deferred.values()), folder, std, seed, progress)
    devices = {}
    for label, usage in plan.devices.items():
        key = usage.key
        devices[label] = DeviceLoad(
            device=label, blocks=len(usage.modules), planned_bytes=usage.bytes,
            allocated_bytes=(torch.cuda.memory_allocated(key) - before[key] if is_gpu(key) and key in before
                             else _host_bytes(model) if key == "cpu" else None),
            seconds=finished.get(label, 0.0),
        )
    read = sum(e.nbytes for e in entries.values()) - mapped_bytes if entries else 0
    return {"devices": devices, "bytes_read": read, "mapped_bytes": mapped_bytes}


def _host_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors in host memory (quantized ones as their library stores them; shared ones once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "cpu":
            continue
        for stored in stored_tensors(tensor):
            if stored.data_ptr() not in seen:
                seen.add(stored.data_ptr())
                total += stored.numel() * stored.element_size()
    return total


def _tied_groups(model: nn.Module) -> list[list[str]]:
    from accelerate.utils import find_tied_parameters

    return find_tied_parameters(model)


def _release(model: nn.Module) -> None:
    """Drop every tensor a failed load allocated, so no GPU memory stays held."""
    for module in model.modules():
        for key in list(module._parameters):
            module._parameters[key] = None
        for key in list(module._buffers):
            module._buffers[key] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
