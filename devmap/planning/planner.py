"""`devmap.plan`: where each block of a model goes, as a plain JSON-serializable report (pure; builds on meta)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import torch
from torch import nn

from .budget import Budget, resolve_budget
from ..errors import DoesNotFitError, UsageError
from .devices import DeviceKey, device_label
from .memory import Size, dtype_name, format_bytes, parse_dtype
from .device_maps import DeviceMapSpec, in_model_order, normalize_device_map, owner_of, validate_device_map
from .models import ModelSource, default_no_split, resolve_source
from .plan_report import DeviceUsage, Plan
from .placement import DeviceMap, kept_precision, module_sizes, place, usage, with_extra
from .contiguous import contiguous_split
from .runtime_memory import runtime_by_unit
from .runtime_room import DeviceRuntime, by_device, gpu_limits_with_room, held_extras, transient_room
from .tensor_parallel import TensorSplit, group_budget, shard_source
from .workload import Workload
from .quantization import (Quantization, check_placement, extra_bytes, quantized_weights, resolve_quantization,
                           special_dtypes)


def plan(
    source: Union[str, Path, nn.Module, ModelSource],
    device_map: DeviceMapSpec = "auto",
    max_memory: str | Mapping[DeviceKey, Size] | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    gpus: int | None = None,
    gpu_memory: Size | None = None,
    offload_folder: str | None = None,
    no_split_module_classes: list[str] | None = None,
    quantization: Any = None,
    workload: Workload | None = None,
    tensor_parallel: int = 1,
) -> Plan:
    """Place `source` (preset name, local HF directory or nn.Module) on devices without allocating memory.

    `device_map` is a strategy (auto, balanced, balanced_low_0, sequential), one device for the whole model (0,
    "cuda:1", "cpu", torch.device), an explicit {module name: device}, or a .json file holding one. Budgets come from
    `max_memory`, simulated `gpus` x `gpu_memory`, or this machine (see devmap.planning.budget.resolve_budget). `dtype`
    sets the size of each weight; `quantization` ("int8", "int4", "nf4", "fp8" or a transformers BitsAndBytesConfig)
    counts the blocks' Linear weights at 1 or ½ byte. `workload` (`devmap.planning.workload.parse_workload`) plans
    the memory running needs as well: KV cache, activations, gradients and optimizer state, each on the device of
    the block that holds it. `tensor_parallel` N > 1 splits every attention and MLP block of a LLaMA-family model
    over each group of N GPUs (`devmap.planning.tensor_parallel`); the groups are planned as the devices of the map.
    """
    return planner(source, device_map, max_memory, dtype, gpus=gpus, gpu_memory=gpu_memory,
                   offload_folder=offload_folder, no_split_module_classes=no_split_module_classes,
                   quantization=quantization, tensor_parallel=tensor_parallel)(workload)


def planner(
    source: Union[str, Path, nn.Module, ModelSource],
    device_map: DeviceMapSpec = "auto",
    max_memory: str | Mapping[DeviceKey, Size] | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    gpus: int | None = None,
    gpu_memory: Size | None = None,
    offload_folder: str | None = None,
    no_split_module_classes: list[str] | None = None,
    quantization: Any = None,
    tensor_parallel: int = 1,
) -> Callable[[Workload | None], Plan]:
    """`plan` of one source, map and budget for any workload (None: the weights alone), as `workload -> Plan`: the
    arguments are checked, the source read, the budget resolved and the model built on the meta device once, for
    callers that plan the same model for many workloads (a service finding its largest batch plans it a dozen
    times). Every plan it makes shares that meta model (`Plan.model`), which planning leaves as it found it; a plan
    of a LLaMA source's weights alone places its layout (`ModelSource.layout`: the same names and shapes, no
    transformers import), and the first workload builds transformers' model, which it runs on the meta device."""
    device_map = normalize_device_map(device_map)
    torch_dtype = parse_dtype(dtype)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise UsageError(f"invalid tensor_parallel={tensor_parallel!r}: it must be a positive integer")
    model_source = resolve_source(source)
    budget = resolve_budget(max_memory, gpus=gpus, gpu_memory=gpu_memory, offload_folder=offload_folder)
    quantized, torch_dtype = resolve_quantization(quantization, torch_dtype, model_source)
    check_could_fit(model_source, budget, torch_dtype, quantized)
    if tensor_parallel > 1:
        return lambda workload: _split_plan(model_source, tensor_parallel, device_map, budget, torch_dtype,
                                            no_split_module_classes, quantized, workload)
    layout = model_source.layout()
    built = {"model": None if model_source.settings is not None else layout}

    def plan_for(workload: Workload | None) -> Plan:
        model = layout
        if workload is not None:  # runtime memory runs the model on the meta device: transformers' own
            model = built["model"] = built["model"] or model_source.build("meta")
        return plan_model(model, model_source, device_map, budget, torch_dtype, no_split_module_classes, quantized,
                          workload)

    return plan_for


def _split_plan(model_source: ModelSource, size: int, device_map: DeviceMapSpec, budget: Budget, dtype: torch.dtype,
                no_split: list[str] | None, quantization: Quantization | None, workload: Workload | None) -> Plan:
    """`plan` with tensor parallelism: the model one GPU of a group holds (`local_config`) planned over one budget per
    group, then spread over every GPU of each group."""
    local, vocab = shard_source(model_source, size)
    groups_budget, groups = group_budget(budget, size)
    if isinstance(device_map, Mapping):  # a map names each group by its first GPU; the groups' budgets are by index
        firsts = {group[0]: index for index, group in enumerate(groups)}
        others = sorted({key for key in device_map.values() if isinstance(key, int) and key not in firsts})
        if others:
            raise UsageError(f"with tensor parallelism a map names each group of {size} GPUs by its first "
                             f"({', '.join(device_label(g[0]) for g in groups)}), not {device_label(others[0])}")
        device_map = {name: firsts.get(key, key) if isinstance(key, int) else key
                      for name, key in device_map.items()}
    plan_of_one = plan_model(local.build("meta"), local, device_map, groups_budget, dtype, no_split, quantization,
                             workload)
    return _spread(plan_of_one, TensorSplit(size, groups, vocab), budget)


def plan_shard(source: Union[str, Path, ModelSource], size: int, rank: int,
               max_memory: str | Mapping[DeviceKey, Size] | None = None, dtype: str | torch.dtype | None = None,
               workload: Workload | None = None, stages: Mapping[str, DeviceKey] | None = None) -> Plan:
    """The plan of the shard process `rank` holds of `source` split `size` ways (`devmap.planning.tensor_parallel`),
    with room for `workload` (what that process's model runs: its own KV heads). The budget's GPUs (from
    `max_memory`, else the machine's; the first multiple of `size` of them) make groups of `size`, the pipeline's
    stages; the whole split is planned over them (`plan(..., tensor_parallel=size)`) and this process holds its GPU
    of each group (`shard_of`): with 2 processes on 4 GPUs, rank 0 holds cuda:0 and cuda:2. `stages`: the whole
    split's map (`Plan.device_map` of `plan` or `split_map(shard)`, each group's first GPU) that another process
    chose, so that every process places each block in the same stage. Without GPUs, the shard is whole on the CPU."""
    model_source = resolve_source(source)
    torch_dtype = parse_dtype(dtype) or model_source.default_dtype
    budget = resolve_budget(max_memory)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise UsageError(f"invalid rank {rank!r} of a split of {size}: it must be 0 to {size - 1}")
    gpus = [g for g in budget.gpus if isinstance(g, int)]
    if not gpus:  # gloo processes on the CPU: each holds its shard whole there
        if "cpu" not in budget.limits:
            raise UsageError(f"the budget has neither GPUs nor cpu for this process's shard ({budget.label()})")
        local, vocab = shard_source(model_source, size)
        shard = plan_model(local.build("meta"), local, {"": "cpu"}, Budget({"cpu": budget.limits["cpu"]}, False),
                           torch_dtype, workload=workload)
        if shard.warnings:
            raise DoesNotFitError(f"{model_source.name} split {size} ways does not fit cpu: {shard.warnings[0]}")
        return replace(shard, tensor_parallel=TensorSplit(size, (tuple(range(size)),), vocab))
    if len(gpus) < size:
        raise UsageError(f"a split of {size} runs one process per GPU, and the budget has {len(gpus)} GPU(s)")
    used = gpus[:len(gpus) // size * size]
    grouped = Budget({g: budget.limits[g] for g in used}, budget.simulated)
    whole = _split_plan(model_source, size, dict(stages) if stages else "auto", grouped, torch_dtype, None, None,
                        workload)
    if whole.warnings:
        raise DoesNotFitError(f"{model_source.name} split {size} ways does not fit "
                              f"{', '.join(device_label(g) for g in used)}: {whole.warnings[0]}")
    return shard_of(whole, rank)


def shard_of(whole: Plan, rank: int) -> Plan:
    """The plan of process `rank`'s shard of a tensor-parallel plan (`plan(..., tensor_parallel=N)`): its GPU of each
    group holds what the group's plan gives each of its GPUs; the map names that GPU, the totals count one shard."""
    split = whole.tensor_parallel
    if split is None:
        raise UsageError("the plan does not split the model: plan it with tensor_parallel=N")
    device_map = {name: split.group_of(first)[rank] if isinstance(first, int) else first
                  for name, first in whole.device_map.items()}
    held = {device_label(key) for key in device_map.values()}
    devices = {label: usage for label, usage in whole.devices.items() if label in held}
    assert whole.model is not None
    params = sum(p.numel() for p in whole.model.parameters())
    return replace(whole, device_map=device_map, devices=devices, total_params=params,
                   total_bytes=sum(usage.bytes for usage in devices.values()))


def split_map(shard: Plan) -> dict[str, DeviceKey]:
    """The whole split's map of a shard's plan (each block on its group's first GPU): what `plan_shard(stages=...)`
    takes to place every process's blocks in the same stages."""
    split = shard.tensor_parallel
    if split is None:
        raise UsageError("the plan does not split the model: plan it with tensor_parallel=N")
    return {name: split.group_of(key)[0] if isinstance(key, int) else key for name, key in shard.device_map.items()}


def _spread(local: Plan, split: TensorSplit, budget: Budget) -> Plan:
    """The plan of one GPU per group (`local`, planned over `group_budget`'s budgets) as the plan of every GPU: the
    map names each group's first GPU, each GPU of a group holds what the local plan gives the group, and the totals
    count the whole model (split tensors times `split.size`, whole ones once)."""
    devices = {}
    for held in local.devices.values():
        for gpu in split.groups[held.key]:  # type: ignore[index]
            devices[device_label(gpu)] = replace(held, device=device_label(gpu), key=gpu,
                                                 budget=budget.limits.get(gpu))
    params = whole = 0  # the whole tensors' bytes, as the planner counts them (weights at most at the plan's dtype)
    assert local.model is not None
    for name, param in local.model.named_parameters():
        if split.slice_of(name, tuple(param.shape), 0) is None:
            whole += param.numel() * min(local.dtype.itemsize, param.element_size())
        params += param.numel() * (1 if split.slice_of(name, tuple(param.shape), 0) is None else split.size)
    whole += sum(buffer.numel() * buffer.element_size() for buffer in local.model.buffers())
    return replace(local, device_map={name: split.groups[key][0] for name, key in local.device_map.items()},
                   devices=devices, budget=budget, total_params=params,
                   total_bytes=local.total_bytes * split.size - whole * (split.size - 1), tensor_parallel=split)


def check_could_fit(model_source: ModelSource, budget: Budget, dtype: torch.dtype,
                    quantization: Quantization | None = None) -> None:
    """Refuse, before building anything, a model whose config alone shows it exceeds every budget together."""
    per_param = quantization.bits / 8 if quantization is not None else dtype.itemsize  # a lower bound either way
    least = int(model_source.min_params * per_param)
    available = sum(budget.limits.values())
    if budget.limits and least > available:
        raise DoesNotFitError(
            f"{model_source.name} needs at least {format_bytes(least)} in {dtype_name(dtype)}"
            f"{' quantized to ' + quantization.scheme if quantization else ''} (from its config.json) but the budget "
            f"holds {format_bytes(available)} ({budget.label()}); at least {format_bytes(least - available)} fits "
            "nowhere. Add offload with --max-memory (e.g. cpu=64GiB,disk=200GiB), use more GPUs, or a smaller --dtype"
            + (" or --quantize int8|int4|nf4" if model_source.is_causal_lm and quantization is None else "")
        )


def plan_model(
    model: nn.Module,
    model_source: ModelSource,
    device_map: DeviceMapSpec,
    budget: Budget,
    dtype: torch.dtype,
    no_split_module_classes: list[str] | None = None,
    quantization: Quantization | None = None,
    workload: Workload | None = None,
) -> Plan:
    """Plan an already built model (parameters on meta or real) under `budget`, its quantized weights (if any)
    at their quantized size, with room for what `workload` needs at run time."""
    device_map = normalize_device_map(device_map)
    strategy = device_map if isinstance(device_map, str) else "explicit"
    no_split = no_split_module_classes if no_split_module_classes is not None else default_no_split(model)
    kept = kept_precision(model)
    special = {**kept, **special_dtypes(model, quantization)}
    weights = module_sizes(model, dtype, special, extra_bytes(model, quantization))
    if workload is not None and workload.kind == "train" and quantization is not None:
        raise UsageError("training updates full-precision weights: plan --for train without --quantize")
    runtime = runtime_by_unit(model, workload, dtype, no_split, model_source.is_causal_lm) if workload else {}
    sizes = with_extra(weights, held_extras(model, runtime))  # weights and what each block holds at run time
    if isinstance(device_map, str):
        if not budget.limits or not any(budget.limits.values()):
            raise UsageError("no device has any memory budget: give --max-memory or --gpus N --gpu-memory SIZE")
        limits = gpu_limits_with_room(budget.limits, transient_room(runtime))
        found = contiguous_split(model, list(runtime), sizes, limits, strategy) if runtime else None
        placed = in_model_order(model, found or place(model, strategy, limits, no_split, dtype, special, sizes))
        _check_fits(model_source.name, placed, sizes, budget, dtype, weights[""], workload)
        warnings: list[str] = []
    else:
        placed = validate_device_map(model, device_map, budget)
        warnings = _over_budget(placed, sizes, budget)

    if quantization is not None:
        owners = {placed[owner_of(name, placed)] for name in quantized_weights(model, quantization)}
        check_placement(quantization, owners)
    return Plan(
        source=model_source.name,
        strategy=strategy,
        dtype=dtype,
        device_map=placed,
        devices=_device_usage(model, placed, weights, budget, by_device(runtime, placed)),
        total_params=sum(p.numel() for p in model.parameters()),
        total_bytes=weights[""],
        budget=budget,
        no_split_module_classes=no_split,
        warnings=warnings,
        quantization=quantization,
        unquantized_bytes=module_sizes(model, dtype, kept)[""] if quantization is not None else None,
        workload=workload,
        model=model,
        model_source=model_source,
    )


def _check_fits(name: str, placed: DeviceMap, sizes: dict[str, int], budget: Budget, dtype: torch.dtype,
                weights: int, workload: Workload | None) -> None:
    used = usage(placed, sizes)
    on_disk = used.get("disk", 0)
    overflow = on_disk if "disk" not in budget.limits else max(0, on_disk - budget.limits["disk"])
    if not overflow:
        return
    available = sum(budget.limits.values())
    needs = f"{format_bytes(sizes[''])} in {dtype_name(dtype)}"
    smaller = ""
    if workload is not None:
        needs = (f"{needs} ({format_bytes(weights)} of weights and {format_bytes(sizes[''] - weights)} held to "
                 f"{workload.describe()})")
        smaller = "a smaller workload, "
    raise DoesNotFitError(
        f"{name} needs {needs} but the budget holds {format_bytes(available)} ({budget.label()}); "
        f"{format_bytes(overflow)} fits nowhere. Add offload with --max-memory (e.g. cpu=64GiB,disk=200GiB), use "
        f"more GPUs, {smaller}or a smaller --dtype (or, for a LLaMA-style model, --quantize int8|int4|nf4)"
    )


def _over_budget(placed: DeviceMap, sizes: dict[str, int], budget: Budget) -> list[str]:
    used = usage(placed, sizes)
    return [
        f"{device_label(d)} holds {format_bytes(b)}, over its budget of {format_bytes(budget.limits[d])}"
        for d, b in used.items()
        if d in budget.limits and b > budget.limits[d]
    ]


def _device_usage(model: nn.Module, placed: DeviceMap, sizes: dict[str, int], budget: Budget,
                  runtime: dict[DeviceKey, DeviceRuntime]) -> dict[str, DeviceUsage]:
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        owner = owner_of(name, placed)
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + param.numel()
    keys = list(budget.limits) + [d for d in dict.fromkeys(placed.values()) if d not in budget.limits]
    report: dict[str, DeviceUsage] = {}
    for key in keys:
        names = [n for n, d in placed.items() if d == key]
        report[device_label(key)] = DeviceUsage(
            device=device_label(key),
            modules=names,
            params=sum(counts.get(n, 0) for n in names),
            bytes=sum(sizes.get(n, 0) for n in names),
            budget=budget.limits.get(key),
            key=key,
            **_runtime_fields(runtime.get(key)),
        )
    return report


def _runtime_fields(needs: DeviceRuntime | None) -> dict[str, int]:
    if needs is None:
        return {}
    return {"kv_cache_bytes": needs.kv_cache, "activation_bytes": needs.activations, "other_bytes": needs.other}
