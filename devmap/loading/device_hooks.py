"""accelerate's device hooks on a placed model, as transformers attaches them: each block's inputs move to its device
and the output comes back to the input's device, so that transformers' own forward runs a model whose blocks lie on
several devices (devmap's pipeline bypasses them: `devmap.compat.device_hooks_bypassed`). Used by `devmap.load`,
`devmap.dispatch` and a tensor-parallel shard that spans pipeline stages."""

from __future__ import annotations

from torch import nn

from ..planning.devices import DeviceKey, is_gpu
from ..planning.placement import accelerate_quietly
from ..planning.planner import Plan


def attach_hooks(model: nn.Module, plan: Plan, folder: str | None) -> None:
    """accelerate's hooks move inputs to each block's device and the output back to the input's device (`folder`:
    where disk-offloaded blocks live)."""
    from accelerate import dispatch_model

    gpus = [d for d in plan.device_map.values() if is_gpu(d)]
    main: DeviceKey = gpus[0] if gpus else "cpu"  # accelerate compares main_device with the string "cpu"
    with accelerate_quietly():
        # like transformers: the KV cache is not moved by the hooks (each layer keeps its own on its device)
        dispatch_model(model, device_map=dict(plan.device_map), main_device=main,
                       offload_dir=folder if "disk" in plan.device_map.values() else None, force_hooks=True,
                       skip_keys=getattr(model, "_skip_keys_device_placement", None))
    model.hf_device_map = dict(plan.device_map)
    model.devmap_plan = plan
