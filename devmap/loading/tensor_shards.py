"""One process's shard of a tensor-parallel model (`devmap.load(..., tensor_parallel=N)`, one process per group
member).

The process's model is the one a local config describes (`devmap.planning.tensor_parallel`), built on the meta
device and made on the process's GPU of each group of N (groups of N GPUs are the pipeline's stages: with 2 processes
on 4 GPUs, process 0 holds cuda:0 and cuda:2, process 1 cuda:1 and cuda:3), as process 0 planned it: each tensor is
read from the full checkpoint as the slice this rank holds. Row slices (column-parallel weights, vocabulary rows) are
byte ranges of the file and go straight to the device through the loader's parallel reads; a row-parallel weight's
column slice is read whole into host memory and its columns copied over (the processes of one machine share the
file's pages). The layers where the group's partial results meet come last (`tensor_layers.parallelize`), each over
its stage's process group (`stage_groups`).

The processes are torch.distributed's default group: those started by torchrun (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), initialized here when the caller has not (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DevmapError, UsageError
from ..planning.device_maps import owner_of
from ..planning.devices import DeviceKey, device_label, torch_device
from ..planning.memory import dtype_name
from ..planning.models import ModelSource
from ..planning.planner import Plan, plan_shard, split_map
from ..planning.tensor_parallel import TensorSplit
from ..planning.workload import Workload
from .checkpoint import TensorEntry, index_checkpoint, match_state
from .disk_offload import set_tensor
from .initialization import init_module_
from .load_report import DeviceLoad, LoadReport
from .device_hooks import attach_hooks
from .tensor_layers import check_plain, parallelize
from .transfer import CopyJob, copy_into


def tensor_group(size: int) -> tuple[int, Any]:
    """(this process's rank, the group) for a split of `size`: torch.distributed's default group, initialized from
    the launcher's environment if the caller did not; refused in one line where no launcher started `size`
    processes."""
    if not dist.is_available():
        raise UsageError("tensor parallelism needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        if not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            raise UsageError(f"tensor_parallel={size} runs one process per GPU: start {size} of them with "
                             f"`torchrun --nproc-per-node {size}`")
        if torch.cuda.is_available():  # NCCL's communicator on this process's own GPU, not on GPU 0
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # see shard_worker.join_group
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
                                  % torch.cuda.device_count())
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world != size:
        raise UsageError(f"tensor_parallel={size} splits the model over {size} processes, but {world} were started: "
                         f"start {size} (torchrun --nproc-per-node {size})")
    open_stage_groups(size)
    return dist.get_rank(), dist.group.WORLD


def shard_device() -> torch.device:
    """This process's device: the GPU of its local rank (as torchrun numbers them), or the CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
    return torch.device("cuda", local)


def shard_device_key() -> DeviceKey:
    """`shard_device()` as a device key (`devmap.planning.devices`): what this process's shard plan places it on."""
    device = shard_device()
    return device.index if device.type == "cuda" else "cpu"


def load_shard(model_source: ModelSource, size: int, dtype: torch.dtype, checkpoint: Path | None, *,
               plan: Plan | None = None, workload: Workload | None = None, allow_pickle: bool = False, seed: int = 0,
               workers: int | None = None, progress: Callable[[int], None] | None = None) -> nn.Module:
    """This process's shard of `model_source` split `size` ways, on its GPU of each group (or the CPU), ready to run
    with the others (`devmap.load`'s tensor-parallel path: see the module's docstring). `plan`: the shard's plan
    (`devmap.planning.planner.plan_shard` for this process's rank), else planned here with room for `workload`."""
    start = time.perf_counter()
    rank, group = tensor_group(size)
    if plan is None:
        plan = _agreed_plan(model_source, size, rank, dtype, workload)
    split = plan.tensor_parallel
    assert split is not None and plan.model_source is not None
    held = {g[rank] for g in split.groups} if shard_device_key() != "cpu" else {"cpu"}
    theirs = [label for label, usage in plan.devices.items() if usage.key not in held]
    if theirs:
        raise UsageError(f"the shard's plan places it on {', '.join(theirs)}, which process {rank} of {size} does not "
                         "hold: plan each process's shard for its rank (devmap.planning.planner.plan_shard)")
    dtype = plan.dtype
    model = plan.model_source.build(cpu_buffers=True)
    check_plain(model)
    entries = index_checkpoint(checkpoint, allow_pickle) if checkpoint is not None else None
    devices = {key: torch_device(key) for key in set(plan.device_map.values())}
    before = {key: _allocated(device) for key, device in devices.items()}
    read, initialized = _fill(model, split, rank, plan.device_map, dtype, entries, seed, workers, progress)
    parallelize(model, split, rank, stage_groups(split, rank, group, devices.values()))
    model.eval()
    if len(devices) > 1:  # a shard over pipeline stages: transformers' own forward crosses them as a placed model's
        attach_hooks(model, plan, None)
    model.hf_device_map = dict(plan.device_map)
    model.devmap_plan = plan
    seconds = time.perf_counter() - start
    loads = {}
    for key, device in devices.items():
        usage = plan.devices[device_label(key)]
        allocated = _allocated(device)
        loads[usage.device] = DeviceLoad(usage.device, len(usage.modules), usage.bytes,
                                         None if allocated is None else allocated - (before[key] or 0), seconds)
    model.devmap_load_report = LoadReport(
        source=model_source.name, checkpoint=str(checkpoint) if checkpoint else None, random_init=entries is None,
        dtype=dtype_name(dtype), seconds=seconds, bytes_read=read, initialized=initialized, devices=loads)
    return model


def _agreed_plan(model_source: ModelSource, size: int, rank: int, dtype: torch.dtype,
                 workload: Workload | None) -> Plan:
    """This process's shard plan, its blocks in the stages process 0 chose: each process measures its own free
    memory, so process 0 plans and the others place each block in the same stage (`plan_shard(stages=...)`)."""
    source = model_source.path or model_source.name
    own, word = None, [None]
    if rank == 0:
        try:
            own = plan_shard(source, size, 0, dtype=dtype, workload=workload)
            word = [split_map(own)]
        except DevmapError as exc:  # every process ends with process 0's reason, none waits for it
            word = [exc]
    dist.broadcast_object_list(word, src=0)
    if isinstance(word[0], DevmapError):
        raise word[0]
    return own or plan_shard(source, size, rank, dtype=dtype, workload=workload, stages=word[0])


_STAGE_GROUPS: dict[tuple[int, ...], Any] = {}  # a process group per later stage (by its GPUs), made once


def open_stage_groups(size: int) -> None:
    """Make, on every process of a split of `size` just after the group starts, the process group of each later
    pipeline stage the visible GPUs allow (GPUs size..2·size-1, and so on), bound to this process's GPU of it: made
    before any load, a load that fails on one process leaves no other waiting for it to make one."""
    if not torch.cuda.is_available():
        return
    rank = dist.get_rank()
    for first in range(size, torch.cuda.device_count() // size * size, size):
        _stage_group(tuple(range(first, first + size)), rank)


def _stage_group(members: tuple[int, ...], rank: int) -> Any:
    """The process group of the stage on GPUs `members`, bound to this process's GPU of it (made once)."""
    if members not in _STAGE_GROUPS:
        _STAGE_GROUPS[members] = dist.new_group(list(range(len(members))),
                                                device_id=torch.device("cuda", members[rank]))
    return _STAGE_GROUPS[members]


def stage_groups(split: TensorSplit, rank: int, group: Any, devices: Iterable[torch.device]) -> dict[Any, Any]:
    """The process group of each of the shard's devices: `group` (torch.distributed's default one, whose NCCL
    communicator is on this process's own GPU) for the stage on the first `size` GPUs, and a group of its own for each
    other stage, bound to this process's GPU of it (an NCCL communicator runs on one GPU): those `open_stage_groups`
    made, else made here, by every process in the same order (stage by stage), once per process."""
    groups: dict[Any, Any] = {}
    for device in sorted(devices, key=lambda d: (d.type, d.index or 0)):
        if device.type != "cuda":
            groups[device] = group
            continue
        members = split.group_of(device.index)
        groups[device] = group if members == tuple(range(split.size)) else _stage_group(members, rank)
    return groups


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _fill(model: nn.Module, split: TensorSplit, rank: int, device_map: Mapping[str, DeviceKey], dtype: torch.dtype,
          entries: dict[str, TensorEntry] | None, seed: int, workers: int | None,
          progress: Callable[[int], None] | None) -> tuple[int, list[str]]:
    """Make every tensor of the shard on its device (`device_map`) and fill it with its slice of the checkpoint
    (initialized where the checkpoint has none); returns the bytes read and the names initialized. Initialized
    modules every process holds whole get the same values in every process (drawn from `seed`: processes whose
    copies differed would compute different tokens), split ones this process's own (`seed` + 1 + `rank`)."""
    from accelerate.utils import find_tied_parameters

    state = model.state_dict(keep_vars=True)
    full = {n: _full_shape(split, n, tuple(t.shape)) for n, t in state.items()}
    floating = {n for n, t in state.items() if t.is_floating_point()}
    missing = (set(match_state(full, entries, find_tied_parameters(model), False, floating)) if entries is not None
               else set(full))
    made: dict[int, torch.Tensor] = {}
    jobs: list[CopyJob] = []
    columns: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []  # (host copy of the whole, shard, start, stop)
    to_init: set[str] = set()
    read = 0
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if id(tensor) in made:  # a tied alias
            set_tensor(model, name, made[id(tensor)])
            continue
        entry = None if entries is None else entries.get(name)
        device = torch_device(device_map[owner_of(name, device_map)])  # type: ignore[index]
        if tensor.device.type != "meta" and entry is None:  # a buffer the constructor computed (rotary frequencies)
            value = tensor.to(device)
        else:
            value = torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype,
                                device=device)
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        made[id(tensor)] = value
        set_tensor(model, name, value)
        if name in missing or (entry is None and tensor.device.type == "meta"):
            to_init.add(name.rpartition(".")[0])
            continue
        if entry is None:
            continue
        piece = split.slice_of(name, entry.shape, rank)
        read += entry.nbytes if piece is None or piece[0] == 1 else entry.nbytes // split.size
        if entry.tensor is not None:  # a pickled checkpoint's tensor, in memory already
            whole = entry.tensor if piece is None else entry.tensor.narrow(piece[0], piece[1], piece[2] - piece[1])
            value.data.copy_(whole)
        elif piece is None:
            jobs.append(CopyJob(entry, value.data))
        elif piece[0] == 0:
            jobs.append(CopyJob(_rows(entry, piece[1], piece[2]), value.data))
        else:
            host = torch.empty(entry.shape, dtype=value.dtype)
            jobs.append(CopyJob(entry, host))
            columns.append((host, value.data, piece[1], piece[2]))
    generators: dict[tuple[torch.device, bool], torch.Generator] = {}
    for module_name in sorted(to_init):
        module = model.get_submodule(module_name)
        device = next(module.parameters(recurse=False), next(module.buffers(recurse=False), None)).device
        whole = all(split.slice_of(f"{module_name}.{leaf}", full[f"{module_name}.{leaf}"], rank) is None
                    for leaf, _ in module.named_parameters(recurse=False))
        if (device, whole) not in generators:
            generators[device, whole] = torch.Generator(device=device).manual_seed(seed if whole else seed + 1 + rank)
        init_module_(module, generator=generators[device, whole],
                     std=float(getattr(model.config, "initializer_range", 0.02) or 0.02))
    copy_into(jobs, workers=workers, progress=progress)
    for host, shard, first, last in columns:
        shard.copy_(host[:, first:last])
    return read, sorted(n for n in full if n.rpartition(".")[0] in to_init)


def _full_shape(split: TensorSplit, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape in the full checkpoint of a shard's tensor of `shape`."""
    piece = split.slice_of(name, tuple(s * split.size for s in shape), 0)
    if piece is None:
        return shape
    dim = piece[0]
    return (*shape[:dim], shape[dim] * split.size, *shape[dim + 1:])


def _rows(entry: TensorEntry, first: int, last: int) -> TensorEntry:
    """The entry's rows [first, last): a byte range of its file."""
    row = entry.nbytes // entry.shape[0]
    return replace(entry, shape=(last - first, *entry.shape[1:]), start=entry.start + first * row,
                   end=entry.start + last * row)
