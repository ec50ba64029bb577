"""Write a quantized model in the layout transformers' `from_pretrained` reads back, as its `save_pretrained` does.

torchao weights are flattened by torchao's own `flatten_tensor_state_dict` (inner tensors as `_weight_qdata`,
`_weight_scale`, ... with their layout in the safetensors metadata); bitsandbytes weights are written as its
modules' state_dicts (int8 data with `SCB`, 4-bit data with `absmax`, `quant_map` and the packed quant state).
config.json carries the matching `quantization_config` (devmap.loading.quantize.transformers_config).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..compat import torchao_flat_state_dict
from ..errors import UsageError
from .quantize import transformers_config


def quantized_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write (on the CPU, tied weights once) and the safetensors metadata transformers expects."""
    plan = getattr(model, "devmap_plan", None)
    if plan is None or plan.quantization is None:
        raise UsageError("this model was not loaded quantized by devmap: save it with save_pretrained")
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    if plan.quantization.library == "torchao":
        tensors, metadata = torchao_flat_state_dict(state)
    else:
        tensors, metadata = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, {}
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return tensors, {**metadata, "format": "pt"}


def write_quantized(model: nn.Module, folder: Path, shard_limit: int) -> tuple[list[str], int, int]:
    """config.json (with quantization_config), generation_config.json and safetensors shards of `model` into
    `folder`; shards are cut greedily at `shard_limit` bytes, each carrying the whole metadata. Returns the
    shard names, the number of tensors and their bytes."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tensors, metadata = quantized_tensors(model)
    config = copy.deepcopy(model.config)
    config.quantization_config = transformers_config(model.devmap_plan.quantization, model.devmap_plan.dtype)
    config.dtype = str(model.devmap_plan.dtype).removeprefix("torch.")
    config.save_pretrained(str(folder))
    GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    for shard, name in zip(shards, names):
        save_file(shard, str(folder / name), metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for shard, name in zip(shards, names) for k in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names, len(tensors), total
