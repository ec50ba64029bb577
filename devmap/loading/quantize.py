"""Quantize Linear layers in place with torchao or bitsandbytes, one block at a time, on the layers' own devices.

The planner decides which weights shrink (devmap.planning.quantization); the loader hands this module each
block's Linears with their full-precision weights already on their device, and this module swaps them for the
library's quantized form, so a device never holds more than one block in full precision beyond its plan.
No kernel is hand-written: torchao's `quantize_` (Int4WeightOnlyConfig, Float8DynamicActivationFloat8WeightConfig;
for int8 its `Int8Tensor.from_hp` per weight shape of a block, which is what `quantize_` runs per Linear) and
bitsandbytes' Linear8bitLt / Linear4bit do the work, as they do under transformers.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
from torch import nn

from ..compat import stored_tensors, torchao_int8_rows
from ..errors import UsageError
from ..planning.device_maps import DeviceMap, owner_of
from ..planning.planner import Plan
from ..planning.devices import DeviceKey, device_label, is_gpu
from ..planning.hardware import gpu_capability
from ..planning.quantization import INT4_GROUP, NF4_BLOCK, Quantization, check_fp8_cards
from .checkpoint import TensorEntry
from .transfer import CHUNK_BYTES, CopyJob, copy_into


def check_runnable(quantization: Quantization, devices: set[DeviceKey]) -> None:
    """Refuse, before anything is allocated, a scheme whose library is not installed, or fp8 on `devices` (those
    holding quantized blocks) without FP8 tensor cores (where blocks go is the planner's check:
    `devmap.planning.quantization.check_placement`)."""
    module = "torchao" if quantization.library == "torchao" else "bitsandbytes"
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"--quantize {quantization.scheme} uses {module}, which is not installed: "
                         f"pip install {module}") from None
    check_fp8_cards(quantization, {device_label(key): gpu_capability(key) if is_gpu(key) else None
                                   for key in devices})


def load_quantized(model: nn.Module, plan: Plan, later: dict[str, tuple[torch.device, TensorEntry | None]],
                    std: float, seed: int, workers: int | None, progress: Callable[[int], None] | None) -> None:
    """Block by block: allocate its Linear weights at the plan's dtype on their device, fill them (checkpoint, or
    N(0, std) where it has none), then let the library quantize them. A helper thread reads block i + 1 while
    this thread quantizes block i, so a device holds at most two blocks in full precision beyond its plan."""
    assert plan.quantization is not None
    units = {name for name, module in model.named_modules()
             if type(module).__name__ in plan.no_split_module_classes}
    by_block: dict[str, list[str]] = {}
    for name in later:
        by_block.setdefault(block_of(name, plan.device_map, units), []).append(name)
    ready: "queue.Queue[list[str] | BaseException | None]" = queue.Queue()
    slots = threading.Semaphore(2)  # blocks in full precision: the one being read, the one being quantized
    stop = threading.Event()

    def read_blocks() -> None:
        generators: dict[torch.device, torch.Generator] = {}
        try:
            for names in by_block.values():
                slots.acquire()
                if stop.is_set():
                    return
                jobs, filled = [], set()
                for name in names:
                    device, entry = later[name]
                    layer = model.get_submodule(name.rpartition(".")[0])
                    layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=plan.dtype, device=device),
                                                requires_grad=False)
                    if entry is not None:
                        jobs.append(CopyJob(entry, layer.weight.data))
                    else:
                        generator = generators.setdefault(device, torch.Generator(device=device).manual_seed(seed))
                        layer.weight.data.normal_(0.0, std, generator=generator)
                        filled.add(device)
                # smaller chunks than a whole-model read, so every reader thread has a share of one block
                size = sum(job.dst.numel() * job.dst.element_size() for job in jobs)
                # the readers' streams are synchronized when copy_into returns; a device-wide synchronize
                # would also wait for the quantization kernels this overlaps with
                copy_into(jobs, workers=workers, progress=progress, synchronize=False,
                          chunk_bytes=max(4 * 2**20, min(CHUNK_BYTES, size // 16)))
                for device in filled - {torch.device("cpu")}:
                    torch.cuda.current_stream(device).synchronize()  # random fills, queued on this thread
                ready.put(names)
        except BaseException as error:  # handed to the quantizing thread, which re-raises it
            ready.put(error)
            return
        ready.put(None)

    reader = threading.Thread(target=read_blocks, name="devmap-quantized-reader", daemon=True)
    reader.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            quantize_linears(model, [name.rpartition(".")[0] for name in item], plan.quantization)
            slots.release()
    finally:
        stop.set()
        slots.release()  # a reader waiting for a slot wakes up and stops
        reader.join()


def block_of(name: str, device_map: DeviceMap, units: set[str]) -> str:
    """The block a tensor is read and quantized with: the unit around it (`units`: the modules the plan never splits,
    a decoder layer), or its device-map entry where that is deeper (a unit split over devices) or there is no unit
    (embeddings, head). A model placed whole on one device (`{"": 0}`) is still quantized unit by unit."""
    owner = owner_of(name, device_map) or ""
    parts = name.split(".")
    unit = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in units), "")
    return unit if len(unit) > len(owner) else owner


def quantize_linears(model: nn.Module, layer_names: list[str], quantization: Quantization) -> None:
    """Swap each named Linear of `model` (full-precision weight on its device) for its quantized form, in place."""
    if quantization.library == "torchao":
        from torchao.quantization import quantize_

        config = torchao_config(quantization)
        if quantization.scheme == "int8":
            torchao_int8_rows([model.get_submodule(name) for name in layer_names], config)
            return
        for name in layer_names:
            quantize_(model.get_submodule(name), config)
        return
    for name in layer_names:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _bitsandbytes_linear(model.get_submodule(name), quantization))


def torchao_config(quantization: Quantization) -> Any:
    """torchao's config for a scheme. int4 packs for tinygemm (torch's own `_weight_int4pack_mm` CUDA kernel):
    torchao's default int4 layout needs the separate mslk kernel package, which pip does not pull in.

    Neither config touches inductor's settings (`set_inductor_config=False`): by default torchao turns on, for the
    whole process and for good, coordinate-descent autotuning of every kernel inductor compiles. Loading a quantized
    model would then change how every later compile in the process runs (a service compiling a 1.1B int8 model's
    decode steps on an H100 was still tuning kernels after minutes when its process crashed), while devmap's
    decode reads int8 weights with its own kernel and int4 ones with tinygemm, which those settings never reach."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if quantization.scheme == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if quantization.scheme == "fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    return Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)


def transformers_config(quantization: Quantization, dtype: torch.dtype) -> Any:
    """The `quantization_config` with which transformers' `from_pretrained` quantizes the same way (same library,
    same layout, same skipped modules): for comparing against it and for the config.json of a saved model."""
    skip = list(quantization.skip_modules)
    if quantization.library == "torchao":
        from transformers import TorchAoConfig

        return TorchAoConfig(torchao_config(quantization), modules_to_not_convert=skip)
    from transformers import BitsAndBytesConfig

    if quantization.scheme == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_use_double_quant=False, llm_int8_skip_modules=skip)


def _bitsandbytes_linear(layer: nn.Linear, quantization: Quantization) -> nn.Module:
    import bitsandbytes as bnb

    device = layer.weight.device
    bias = layer.bias is not None
    weight = layer.weight.data
    if quantization.scheme == "int8":
        weight = weight.to("cpu")  # Int8Params quantizes only as its weight moves from the CPU onto a GPU
        new: nn.Module = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=bias,
                                             has_fp16_weights=False, threshold=6.0, device="meta")
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        # no double quantization (transformers' default, bnb_4bit_use_double_quant=False): float32 absmax per block
        new = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=bias, compute_dtype=weight.dtype,
                                compress_statistics=False, quant_type="nf4", device="meta")
        new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK,
                                       compress_statistics=False)  # quantized where it is, by .to(device) below
    if bias:
        new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    return new.to(device)


def quantized_nbytes(module: nn.Module) -> int:
    """Bytes a module's parameters hold, quantized ones counted as the library stores them."""
    return sum(t.numel() * t.element_size() for p in module.parameters() for t in stored_tensors(p))
