"""Compiling a served model's steps in a process of its own (`devmap serve`'s compile beside serving).

A compile in the serving process shares its interpreter with the serving thread: dynamo's tracing and inductor's
lowering hold it for tens of seconds, the serving thread's steps wait for it between their calls into torch, and its
captures pause while the compile's runs use the card. Its eager steps then take many times their pace, and its
requests' time to first token with them (docs/serving.md). Here the compile runs in another process instead: it
builds the same model cut down to one decoder layer per device its layers use (the same config, dtype, quantization,
attention and map otherwise, random weights: a compile needs shapes, not values), compiles and warms up its steps at
every shape, and keeps each compiled region in the region store the service uses (`generation.region_store`; a layer's
entry serves every layer of the model: they run one compiled code), then marks the model's warm-up as run whole
(`warm_marks`). The serving process meanwhile replays its captured eager steps; it then loads the stored entries in
a light warm-up, as a restart does, and its batches move to them.

The process runs at a lower CPU priority, within a cap of its weights and ROOM on each GPU, and only where the GPU
lends that beside all the serving process may still take there (its models' KV caches filled as their plans made
room for, and KEEP); it ends when the serving process does and is stopped with the model's unload. It warms up as a
compile beside serving does (no captures, joins packed as while captures are paused, joiners riding as the served
model's size says), so that its entries are those the serving process's light warm-up and batches look for. Where it
cannot run, or fails (its last line is logged), the serving process compiles the steps itself, as it did before, and
logs why.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..planning.plan_report import LAYER_ENTRY

log = logging.getLogger("devmap.serving")

ROOM = 3 << 30  # bytes the compile's process may use on a GPU beside its weights (its CUDA context excepted)
KEEP = 2 << 30  # bytes of a GPU's free memory left to the serving process beside them
NICE = 10  # the compile's process (and its compile workers) yields the CPU to the serving process


@dataclass(frozen=True)
class CompileJob:
    """What the compile's process builds and compiles: the model's config cut to its layers kept (every list of one
    value per layer cut alike), the map of that model, its dtype and quantization (`Quantization.to_dict`), the
    warm-up's batch (rows, context, whether joiners ride: the served model's choice), the interpreter's thread count
    (compiled regions guard on it), the marker key of the served model its warm-up stands for, and the most memory it
    may use on each GPU."""

    config: dict[str, Any]
    device_map: dict[str, str]
    dtype: str
    quantization: dict[str, Any] | None
    rows: int
    context: int
    riding: bool
    threads: int
    key: str
    memory: dict[str, int]


def cut_down(config: dict[str, Any], device_map: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]] | None:
    """`config` and `device_map` cut to one decoder layer per run of layers on one device (in the layers' order; a
    whole model on one device keeps one), renumbered from 0; None where the map places no layers by name."""
    layers = int(config.get("num_hidden_layers") or 0)
    if not layers:
        return None
    if set(device_map) == {""}:
        kept = [0]
        cut = dict(device_map)
    else:
        runs: list[tuple[int, str]] = []  # (layer, device) of every layer the map names
        cut, stack = {}, None
        for name, device in device_map.items():
            if not LAYER_ENTRY.search(name):
                cut[name] = device
                continue
            stack, index = name.rsplit(".", 1)
            runs.append((int(index), device))
        if stack is None:
            return None
        runs.sort()
        kept = [index for n, (index, device) in enumerate(runs) if n == 0 or runs[n - 1][1] != device]
        devices = dict(runs)
        for new, index in enumerate(kept):
            cut[f"{stack}.{new}"] = devices[index]
    small = dict(config)
    small["num_hidden_layers"] = len(kept)
    for name, value in config.items():  # per-layer settings (layer_types, ...) keep the layers kept
        if isinstance(value, list) and len(value) == layers and name != "num_hidden_layers":
            small[name] = [value[index] for index in kept]
    return small, cut


def job_for(model: Any, source: Path, rows: int, context: int, riding: bool | None, key: str | None,
            kv_room: int, others: Sequence[tuple[Any, int]] = ()) -> CompileJob | str:
    """The job that compiles the steps of `model` (loaded from `source`, its marker `key`) for batches of `rows` rows
    in a process of its own, or why the serving process compiles them instead: no region store (`key` None: the
    entries would not reach this process), a store that holds them already (`warmed`), no config.json at `source`, a
    quantization other than devmap's schemes, a map that names no layers or places one off the GPUs, or too little room
    on a GPU (`room`: `kv_room` is the bytes of KV cache its plan made room for, `others` the other resident models
    with theirs)."""
    import torch

    from ..generation.mixed_joins import rides_by_default
    from ..planning.memory import dtype_name
    from ..planning.quantization import Quantization
    from .warm_marks import warmed

    plan, config_file = model.devmap_plan, source / "config.json"
    quantization = plan.quantization
    if key is None:
        return "no compile cache to hand its compiled steps over in"
    if warmed(key):  # a warm-up of the model ran whole before: the store holds its entries, this process loads them
        return "the compile cache holds them already"
    if not config_file.is_file():
        return f"no config.json in {source}"
    if quantization is not None and not isinstance(quantization, Quantization):
        return "its quantization is not one of devmap's schemes"
    cut = cut_down(json.loads(config_file.read_text()), {name: str(device) for name, device in
                                                         model.hf_device_map.items()})
    if cut is None:
        return "its device map names no decoder layers"
    memory = room(model, cut[1], kv_room, others)
    if isinstance(memory, str):
        return memory
    # whether joiners ride follows the model's size where nobody says: the cut-down model's would not be the model's
    rides = rides_by_default(model) if riding is None else riding
    return CompileJob(config=cut[0], device_map=cut[1], dtype=dtype_name(plan.dtype),
                      quantization=quantization.to_dict() if quantization is not None else None, rows=rows,
                      context=context, riding=rides, threads=torch.get_num_threads(), key=key, memory=memory)


@dataclass(frozen=True)
class _Footprint:
    """Where a model's bytes lie on the GPUs: all its tensors, those outside its decoder layers, its largest decoder
    layer and its decoder layers' count on each GPU index."""

    held: dict[int, int]
    outside_layers: dict[int, int]
    largest_layer: dict[int, int]
    layers: dict[int, int]

    def most(self, kv_room: int) -> dict[int, int]:
        """The most the model holds on each GPU once its batches' KV caches fill the `kv_room` its plan made (spread
        as its layers are)."""
        every = sum(self.layers.values()) or 1
        return {index: held + kv_room * self.layers.get(index, 0) // every for index, held in self.held.items()}


def _footprint(model: Any) -> _Footprint:
    """`model`'s bytes on each GPU, each tensor counted once; a decoder layer's are on the GPU of its first tensor."""
    held: dict[int, int] = {}
    in_layers: dict[int, int] = {}
    largest: dict[int, int] = {}
    layers: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_cuda:
            held[tensor.device.index] = held.get(tensor.device.index, 0) + tensor.nbytes
    for module_name, module in model.named_modules():
        if not LAYER_ENTRY.search(module_name):
            continue
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_cuda]
        if tensors:
            index, size = tensors[0].device.index, sum(t.nbytes for t in tensors)
            in_layers[index] = in_layers.get(index, 0) + size
            largest[index] = max(largest.get(index, 0), size)
            layers[index] = layers.get(index, 0) + 1
    return _Footprint(held, {index: size - in_layers.get(index, 0) for index, size in held.items()}, largest, layers)


def room(model: Any, device_map: dict[str, str], kv_room: int,
         others: Sequence[tuple[Any, int]] = ()) -> dict[str, int] | str:
    """The memory the compile's process may use on each GPU of `device_map` (the cut-down map of `model`): what is
    not a layer of `model` there, its largest layer there for each layer kept, and ROOM for the rest; or why a GPU
    cannot lend that. A GPU lends what is free less what the serving process may still take there: the most its
    resident models (`model` with the KV room its plan made, `others` with theirs) hold once their KV caches fill,
    and KEEP, beyond what it holds already (its allocator's reserved bytes: the caches its warm-up made are in
    them)."""
    import torch

    from ..planning.devices import is_gpu, parse_device_key

    own = _footprint(model)
    most = own.most(kv_room)
    for other, other_kv in others:
        for index, size in _footprint(other).most(other_kv).items():
            most[index] = most.get(index, 0) + size
    kept: dict[int, int] = {}
    for name, device in device_map.items():
        index = parse_device_key(device)
        if not is_gpu(index):
            return f"its map places {name or 'the model'} on {device}"
        kept[index] = kept.get(index, 0) + (1 if LAYER_ENTRY.search(name) or name == "" else 0)
    memory = {}
    for index, count in kept.items():
        needed = ROOM + own.outside_layers.get(index, 0) + count * own.largest_layer.get(index, 0)
        free, _ = torch.cuda.mem_get_info(index)
        ahead = max(0, most.get(index, 0) + KEEP - torch.cuda.memory_reserved(index))
        if free - ahead < needed:
            return (f"GPU {index} lends {max(0, free - ahead) / 2**30:.1f} GiB beside what serving may still take "
                    f"there, and the compile needs {needed / 2**30:.1f} GiB")
        memory[str(index)] = int(needed)
    return memory


def compile_elsewhere(job: CompileJob, stop: Callable[[], bool], poll: float = 0.2) -> float | None:
    """Run `job` in a process of its own: the seconds it took once it ran whole, None where it failed (logged with its
    last line) or `stop()` turned True (it is ended)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="devmap-compile-") as folder:
        Path(folder, "config.json").write_text(json.dumps(job.config))
        Path(folder, "job.json").write_text(json.dumps(asdict(job)))
        errors = Path(folder, "errors.txt")
        # devmap importable there as here, after whatever the environment puts first
        package_root = str(Path(__file__).resolve().parents[2])
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [*filter(None, [os.environ.get("PYTHONPATH")]), package_root])}
        with errors.open("w") as written:
            process = subprocess.Popen([sys.executable, "-m", __name__, folder, str(os.getpid())],
                                       stdin=subprocess.DEVNULL, stdout=written, stderr=subprocess.STDOUT,
                                       env=environment)
            while process.poll() is None:
                if stop():
                    _end(process)
                    return None
                time.sleep(poll)
        if process.returncode != 0:
            lines = [line for line in errors.read_text(errors="replace").splitlines() if line.strip()]
            log.warning("compiling the steps in a process of their own failed (%s); they compile in the serving "
                        "process", lines[-1].strip() if lines else f"exit status {process.returncode}")
            return None
    seconds = time.perf_counter() - started
    log.info("steps compiled in a process of their own in %.1f s", seconds)
    return seconds


def _end(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _watch(parent: int) -> None:
    """End this process once `parent` (the serving process) has ended."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def run(folder: Path) -> None:
    """The compile's process: the job in `folder`, its cut-down model compiled and warmed up at every shape."""
    import torch

    from ..generation.joined_projections import join_projections
    from ..loading.loader import load
    from ..planning.quantization import Quantization
    from .compile_cache import keep_regions
    from .prepare import attention_without_plans, pin_attention, prepare_product_kernels
    from .warm_up import warm_up

    job = CompileJob(**json.loads((folder / "job.json").read_text()))
    torch.set_num_threads(job.threads)
    for device, limit in job.memory.items():
        index = int(device)
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)
    keep_regions()
    attention_without_plans()  # the attention the serving process runs: its compiled steps pick theirs as it would
    quantization = Quantization(**{**job.quantization, "skip_modules": tuple(job.quantization["skip_modules"])}) \
        if job.quantization else None
    model = load(str(folder), device_map=job.device_map, dtype=job.dtype, quantization=quantization,
                 random_weights=True)
    join_projections(model)
    prepare_product_kernels(model)
    pin_attention(model)
    # as beside serving (captures paused, joins packed as while they are): the entries a warm-up beside serving
    # makes, which the serving process's light warm-up and its batches then find
    warm_up(model, job.rows, job.context, job.riding, beside_serving=True, key=job.key)


def main(argv: list[str]) -> int:
    folder, parent = Path(argv[0]), int(argv[1])
    with contextlib.suppress(OSError, AttributeError):  # its compile's workers inherit it
        os.nice(NICE)
    threading.Thread(target=_watch, args=(parent,), name="devmap-compile-watch", daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        run(folder)
    except Exception as exc:  # noqa: BLE001 - its reason, the last line, is the serving process's warning
        text = str(exc).strip()
        log.error("%s: %s", type(exc).__name__, text.splitlines()[0] if text else "")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
