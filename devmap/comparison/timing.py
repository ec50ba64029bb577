"""The model-parallel tutorial's timing harness (train(), timeit, mean and std) and `run_comparison`, as plain data."""

from __future__ import annotations

import platform
import timeit
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
from torch import nn, optim

from ..errors import UsageError

Device = Union[str, torch.device]
# A system is built, fresh for every timed run, from the device list and the harness config.
SystemBuilder = Callable[[Sequence[torch.device], "HarnessConfig"], nn.Module]

MODEL_PARALLEL = "Model Parallel"
SINGLE_GPU = "Single GPU"
PIPELINE = "Pipelining Model Parallel"
TUTORIAL_SYSTEMS = (MODEL_PARALLEL, SINGLE_GPU, PIPELINE)  # the tutorial's order of runs and bars
TOY_BATCH = 20  # the tutorial's ToyModel step: inputs randn(20, 10), labels randn(20, 5)


@dataclass(frozen=True)
class HarnessConfig:
    """Every number of the tutorial's experiment; the defaults are the tutorial's values."""

    num_batches: int = 3
    batch_size: int = 120
    image_w: int = 128
    image_h: int = 128
    num_classes: int = 1000
    repeat: int = 10
    number: int = 1
    lr: float = 0.001
    split_sizes: tuple[int, ...] = (1, 3, 5, 8, 10, 12, 20, 40, 60)
    pipeline_split_size: int = 20
    warmup: int = 0  # untimed train() calls per system before its timed runs (the tutorial has none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_sizes", tuple(self.split_sizes))
        for name in ("num_batches", "batch_size", "image_w", "image_h", "num_classes", "repeat", "number",
                     "pipeline_split_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if not self.split_sizes:
            raise UsageError("split_sizes must name at least one split size")
        bad = [s for s in self.split_sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise UsageError(f"split sizes must be positive integers, got {bad[0]!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        if not self.lr > 0:
            raise UsageError(f"lr must be positive, got {self.lr!r}")


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def train(model: nn.Module, devices: Sequence[torch.device], config: HarnessConfig = HarnessConfig()) -> None:
    """The tutorial's train(model): `num_batches` SGD steps on random images, then CUDA devices synchronized.

    Inputs are made on the CPU with torch.randn and moved to devices[0]; one-hot labels (indices
    drawn once per call) are moved to the output's device; MSELoss, SGD(lr) are made here.
    """
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=config.lr)
    one_hot_indices = torch.LongTensor(config.batch_size).random_(0, config.num_classes).view(config.batch_size, 1)
    for _ in range(config.num_batches):
        inputs = torch.randn(config.batch_size, 3, config.image_w, config.image_h)
        labels = torch.zeros(config.batch_size, config.num_classes).scatter_(1, one_hot_indices, 1)
        optimizer.zero_grad()
        outputs = model(inputs.to(devices[0]))
        labels = labels.to(outputs.device)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    _synchronize(devices)


def train_toy(model: nn.Module, devices: Sequence[torch.device], config: HarnessConfig = HarnessConfig()) -> None:
    """The tutorial's ToyModel step, `num_batches` times: inputs randn(20, 10), labels randn(20, 5) on the output."""
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=config.lr)
    for _ in range(config.num_batches):
        optimizer.zero_grad()
        outputs = model(torch.randn(TOY_BATCH, 10).to(devices[0]))
        labels = torch.randn(TOY_BATCH, 5).to(outputs.device)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    _synchronize(devices)


def time_system(builder: Callable[[], nn.Module], step: Callable[[nn.Module], None], config: HarnessConfig,
                progress: Callable[[], None] | None = None) -> list[float]:
    """`timeit.repeat(stmt, setup, number, repeat)` with the model built in setup; progress() after each run.

    With `config.warmup` > 0, one model is built and trained that many times, untimed, first.

    timeit.repeat is `Timer(stmt, setup).repeat(repeat, number)`, i.e. `repeat` calls of
    `Timer.timeit(number)`; that loop is written out here so progress can be reported in between.
    """
    if config.warmup:  # untimed: kernels, cuDNN/cuBLAS handles and allocator caches get ready
        model = builder()
        for _ in range(config.warmup):
            step(model)
        del model
    holder: dict[str, nn.Module] = {}

    def setup() -> None:
        holder["model"] = builder()

    timer = timeit.Timer(lambda: step(holder["model"]), setup)
    times = []
    for _ in range(config.repeat):
        times.append(timer.timeit(number=config.number))
        if progress is not None:
            progress()
    holder.clear()
    return times


@dataclass
class SystemTiming:
    """Seconds per timed run of one system."""

    mean: float
    std: float
    times: list[float]

    @classmethod
    def of(cls, times: Sequence[float]) -> "SystemTiming":
        return cls(float(np.mean(times)), float(np.std(times)), [float(t) for t in times])


@dataclass
class ComparisonResult:
    """The whole experiment: per-system timings, the split-size sweep, and what it ran on."""

    model: str
    systems: dict[str, SystemTiming]
    sweep: list[dict[str, Any]]
    best_split_size: int
    ratios: dict[str, float]  # system mean / Single GPU mean: below 1 is faster than one device
    config: HarnessConfig
    devices: list[str]
    device_names: dict[str, str]
    placement: dict[str, int]  # module -> index into devices (the Model Parallel stages)
    torch_version: str
    extra_systems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data (the content of results.json)."""
        data = asdict(self)
        data["config"]["split_sizes"] = list(self.config.split_sizes)
        return data


def parse_devices(devices: str | Sequence[Device] | None, needed: int = 2) -> list[torch.device]:
    """"cuda:0,cuda:1", ["cpu", "cpu"] or None (the first `needed` GPUs) -> checked torch devices."""
    if devices is None:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < needed:
            raise UsageError(f"needs {needed} CUDA GPUs, found {found}; "
                             f"pass --devices {','.join(['cpu'] * needed)} with small sizes for a smoke run")
        return [torch.device("cuda", i) for i in range(needed)]
    items = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else list(devices)
    if len(items) < needed or any(isinstance(d, str) and not d for d in items):
        raise UsageError(f"needs at least {needed} devices, got {devices!r}: e.g. cuda:0,cuda:1 or cpu,cpu")
    parsed = []
    for item in items:
        try:
            device = torch.device(item)
        except (RuntimeError, TypeError, ValueError):
            raise UsageError(f"unknown device {str(item)!r}: use cuda:N or cpu") from None
        if device.type == "cuda":
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            device = torch.device("cuda", 0 if device.index is None else device.index)
            if device.index >= found:
                raise UsageError(f"device {str(item)!r} does not exist: this machine has {found} CUDA GPU(s)")
        elif device.type != "cpu":
            raise UsageError(f"unsupported device {str(item)!r}: use cuda:N or cpu")
        parsed.append(device)
    return parsed


def check_micro_batches(config: HarnessConfig) -> None:
    """Refuse sizes where a (micro-)batch is one image with a 1x1 layer4 output: BatchNorm cannot train on it."""
    last = ((config.image_w + 31) // 32, (config.image_h + 31) // 32)  # five stride-2 stages, each rounding up
    if last != (1, 1):
        return
    sizes = [config.batch_size, config.pipeline_split_size, *config.split_sizes]
    if any(1 in (min(s, config.batch_size), config.batch_size % s) for s in sizes):
        raise UsageError(
            f"a micro-batch of 1 image of {config.image_w}x{config.image_h} leaves ResNet50's last BatchNorm one "
            "value per channel, which cannot train: use an image size above 32 or split sizes that never "
            "leave a micro-batch of 1"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return model or f"{platform.machine() or 'unknown'} CPU"


def run_comparison(
    devices: str | Sequence[Device] | None,
    config: HarnessConfig = HarnessConfig(),
    toy: bool = False,
    device_map: str | Mapping[str, Any] | None = None,
    extra_systems: Mapping[str, SystemBuilder] | None = None,
    progress: Callable[[], None] | None = None,
) -> ComparisonResult:
    """Run the tutorial's experiment: Model Parallel, Single GPU, Pipelining (split 20), the split-size sweep.

    `extra_systems` ({label: builder(devices, config) -> nn.Module}) are timed after them with the
    same harness (this is where the "devmap pipeline" system plugs in). `progress` is called once
    per timed run; there are `total_runs(config, extra_systems)` of them.
    """
    from . import tutorial_models as tm

    devs = parse_devices(devices)
    extra = dict(extra_systems or {})
    clash = set(extra) & set(TUTORIAL_SYSTEMS)
    if clash:
        raise UsageError(f"extra system names clash with the tutorial's: {sorted(clash)}")
    if toy:
        placement = {"net1": 0, "relu": 0, "net2": 1}
        step = partial(train_toy, devices=devs, config=config)
        systems: dict[str, Callable[[], nn.Module]] = {
            MODEL_PARALLEL: lambda: tm.ToyModel(devs),
            SINGLE_GPU: lambda: tm.ToyModel(devs[:1]),
        }
        pipelined: Callable[[int], nn.Module] = lambda s: tm.PipelineToyModel(devs, split_size=s)  # noqa: E731
    else:
        check_micro_batches(config)
        index = tm.resolve_placement(devs, device_map)
        placement = dict(zip(tm.RESNET_CHILDREN, index))
        step = partial(train, devices=devs, config=config)
        systems = {
            MODEL_PARALLEL: lambda: tm.ModelParallelResNet50(devs, index, config.num_classes),
            SINGLE_GPU: lambda: tm.single_resnet50(devs[0], config.num_classes),
        }
        pipelined = lambda s: tm.PipelineParallelResNet50(devs, index, config.num_classes, s)  # noqa: E731
    systems[PIPELINE] = lambda: pipelined(config.pipeline_split_size)

    timings = {label: SystemTiming.of(time_system(build, step, config, progress)) for label, build in systems.items()}
    sweep = []
    for size in config.split_sizes:
        t = SystemTiming.of(time_system(partial(pipelined, size), step, config, progress))
        sweep.append({"split_size": size, "mean": t.mean, "std": t.std, "times": t.times})
    for label, builder in extra.items():
        timings[label] = SystemTiming.of(time_system(partial(builder, devs, config), step, config, progress))

    single = timings[SINGLE_GPU].mean
    return ComparisonResult(
        model="toy" if toy else "resnet50",
        systems=timings,
        sweep=sweep,
        best_split_size=min(sweep, key=lambda p: p["mean"])["split_size"],
        ratios={label: (t.mean / single if single > 0 else float("nan")) for label, t in timings.items()},
        config=config,
        devices=[str(d) for d in devs],
        device_names={str(d): _device_name(d) for d in devs},
        placement=placement,
        torch_version=torch.__version__,
        extra_systems=list(extra),
    )


def total_runs(config: HarnessConfig, extra_systems: Mapping[str, Any] | None = None) -> int:
    """How many timed runs run_comparison makes (for a progress bar)."""
    return config.repeat * (len(TUTORIAL_SYSTEMS) + len(config.split_sizes) + len(extra_systems or {}))

