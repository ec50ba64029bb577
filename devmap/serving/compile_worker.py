"""Compiling a model's steps in a process of its own, for a service that compiles them beside its serving
(`--compile-beside`) and finds none of them in its region store (a first start, a new model, map or release).

Compiled in the serving process, dynamo's tracing and inductor's work share its interpreter with the serving thread:
its eager steps run many times slower meanwhile, and captures pause while the compile runs device work. The worker
builds the model's shape again with one decoder layer per pipeline stage, on the same devices, with random weights
of the same dtype and quantization, prepares it as the service does (joined projections, product kernels, the
attention pinned) and runs the same warm-up a compile beside serving runs (`warm_up.warm_up`), so that the region
store (`generation.region_store`) gets every entry the model's steps need: one layer's entries serve every layer (the
regions take a layer's modules and tensors as arguments). The serving process then compiles by loading those entries
(as a restart does), without tracing. A worker that fails (no room on a GPU, a region that cannot be kept) leaves the
serving process to compile in its own interpreter, as before; a finished worker leaves a marker for its job in the
store, so that later starts of the same model go straight to loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("devmap.serving")

ROOM = 2 << 30  # bytes a worker needs free on each of its GPUs beyond its weights (its CUDA context, a warm-up batch)
POLL_SECONDS = 0.2
_LAYER = re.compile(r"^(.*\.layers)\.(\d+)$")


@dataclass(frozen=True)
class WorkerJob:
    """What a worker builds and compiles: the model's config with one layer per stage, where each module goes, its
    dtype and quantization scheme, and the warm-up's batch (rows, context, riding) and thread count (torch's global
    state is among an entry's guards)."""

    config: dict[str, Any]
    device_map: dict[str, Any]
    dtype: str
    quantization: str | None
    rows: int
    context: int
    riding: bool | None
    threads: int

    def key(self) -> str:
        """A digest of the job and of devmap's sources (which make the entries' code)."""
        from ..generation.region_store import sources_digest

        text = json.dumps(asdict(self), sort_keys=True, default=str) + sources_digest()
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def worker_job(model: Any, quantization: Any, rows: int, context: int, riding: bool | None,
               planned: dict[Any, int]) -> WorkerJob | None:
    """The job that compiles `model`'s steps apart, or None where a worker cannot stand in for it: no region store,
    a model not on GPUs alone or split over processes, a quantization given as an object, a map whose layers a
    worker cannot mirror, or too little room on one of its GPUs once the model's plan (`planned`: bytes per device,
    its largest batch's KV cache and activations included) has taken what it has not allocated yet."""
    import torch

    from ..generation.region_store import store_folder

    plan = getattr(model, "devmap_plan", None)
    if store_folder() is None or plan is None or plan.tensor_parallel is not None:
        return None
    if quantization is not None and not isinstance(quantization, str):
        return None
    device_map = _one_layer_per_stage(dict(getattr(model, "hf_device_map", {})))
    config = model.config.to_dict()
    if device_map is None or not isinstance(config.get("num_hidden_layers"), int):
        return None
    stages = sum(1 for name in device_map if _LAYER.match(name)) or 1
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = stages
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:stages]
    layer_bytes = plan.total_bytes / max(layers, 1)
    for device in {_cuda_index(d) for d in device_map.values()}:
        if device is None:
            return None
        still = max(0, planned.get(device, 0) - torch.cuda.memory_reserved(device))  # the plan's, not yet taken
        if torch.cuda.mem_get_info(device)[0] - still < ROOM + 3 * layer_bytes:
            return None
    return WorkerJob(config, device_map, str(plan.dtype).removeprefix("torch."), quantization, rows, context, riding,
                     torch.get_num_threads())


def _one_layer_per_stage(device_map: dict[str, Any]) -> dict[str, Any] | None:
    """The model's map with its decoder layers cut to one per run of layers on one device (a stage), renumbered from
    0; None where it names layers in parts or holds anything off the GPUs."""
    if not device_map or any(_cuda_index(d) is None for d in device_map.values()):
        return None
    if set(device_map) == {""}:
        return dict(device_map)
    layers = sorted((int(m.group(2)), m.group(1), device) for name, device in device_map.items()
                    if (m := _LAYER.match(name)))
    if not layers or any(name.startswith(f"{prefix}.") and not _LAYER.match(name) for _, prefix, _ in layers
                         for name in device_map):
        return None
    out = {name: device for name, device in device_map.items() if not _LAYER.match(name)}
    stage_devices = [device for i, (_, _, device) in enumerate(layers) if i == 0 or device != layers[i - 1][2]]
    for index, device in enumerate(stage_devices):
        out[f"{layers[0][1]}.{index}"] = device
    return out


def _cuda_index(device: Any) -> int | None:
    """The GPU index a map's device names (0, "cuda:1", "cuda"), None for anything else."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    text = str(device)
    if text == "cuda":
        return 0
    match = re.fullmatch(r"cuda:(\d+)", text)
    return int(match.group(1)) if match else None


def compiled_before(job: WorkerJob) -> bool:
    """Whether a worker finished this job in the store before (its entries are there: load them)."""
    marker = _marker(job)
    return marker is not None and marker.exists()


def compile_apart(job: WorkerJob, stop: Callable[[], bool]) -> bool:
    """Run `job` in a worker process and wait for it (ended early where `stop()` turns True); whether it finished.
    A failure is logged with the worker's last line, never raised: the caller compiles in its own process then."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen([sys.executable, "-m", "devmap.serving.compile_worker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=errors, env=os.environ.copy())
        try:
            process.stdin.write(json.dumps(asdict(job)).encode())
            process.stdin.close()
            while process.poll() is None:
                if stop():
                    process.kill()
                    process.wait()
                    return False
                time.sleep(POLL_SECONDS)
        except BaseException:
            process.kill()
            process.wait()
            raise
        if process.returncode != 0:
            errors.seek(0)
            lines = [line for line in errors.read().decode(errors="replace").splitlines() if line.strip()]
            log.info("compiling in a process of its own failed (%s); compiling in the serving process instead",
                     lines[-1].strip() if lines else f"exit status {process.returncode}")
            return False
    marker = _marker(job)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    log.debug("steps compiled in a process of its own in %.1f s", time.perf_counter() - started)
    return True


def _marker(job: WorkerJob) -> Path | None:
    from ..generation.region_store import store_folder

    folder = store_folder()
    return None if folder is None else folder / "compiled-models" / f"{job.key()}.done"


def run(job: WorkerJob) -> None:
    """The worker's work, in this process: build the job's model, prepare it and warm it up as a compile beside
    serving would, its regions kept in the store the environment names (`compile_cache.keep_regions`)."""
    import torch

    from ..loading.loader import load
    from ..planning.planner import planner
    from .compile_cache import compiled_anew, keep_regions
    from .core_client import import_model_stack
    from .prepare import pin_attention, prepare_weights
    from .warm_up import warm_up

    import_model_stack()
    keep_regions()
    torch.set_num_threads(job.threads)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(job.config))
        plan = planner(folder, job.device_map, dtype=job.dtype, quantization=job.quantization)(None)
        model = load(folder, plan=plan, random_weights=True)
    prepare_weights(model, "compile worker")
    pin_attention(model)
    compiled_anew(lambda: warm_up(model, job.rows, job.context, job.riding, beside_serving=True))


def main() -> int:
    job = WorkerJob(**json.loads(sys.stdin.read()))
    run(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
