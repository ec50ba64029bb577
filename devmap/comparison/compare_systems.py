"""devmap's pipeline as systems of the tutorial's harness: tuned once (stage boundary by time, then the
micro-batch count), then rebuilt fresh, with its CUDA graphs captured, in each timed run's setup."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torchvision
from torch import nn

from ..loading.loader import dispatch
from ..pipelining import Pipeline, pipeline
from ..pipelining.residual_parts import parse_unit, split_residual
from ..pipelining.stages import blocks_of
from .timing import HarnessConfig
from ..pipelining.tuning import tune
from .tutorial_models import RESNET_CHILDREN, TUTORIAL_SPLIT

Builder = Callable[[Sequence[torch.device], HarnessConfig], nn.Module]
LABEL = "devmap pipeline"


def stages_from_names(model: nn.Module, names: list[list[str]], devices: Sequence[torch.device]) -> list:
    """[(nn.Sequential of the named blocks, device), ...] for explicit pipeline stages (a name may be the
    head or tail of a cut residual block, "layer2.0[head]")."""
    blocks = dict(blocks_of(model))

    def unit(name: str) -> nn.Module:
        base, role, cut = parse_unit(name)
        if role is None:
            return blocks[name]
        parts = split_residual(blocks[base], cut)
        assert parts is not None, f"{base} cannot be cut at {cut}"
        return parts[0] if role == "head" else parts[1]

    return [(nn.Sequential(OrderedDict((_child(n), unit(n)) for n in group)).to(d), d)
            for group, d in zip(names, devices)]


def _child(name: str) -> str:
    return name.replace(".", "_").replace("[", "_").replace("]", "").replace("@", "_")


def _tutorial_names() -> list[list[str]]:
    names = [n for n, _ in blocks_of(torchvision.models.resnet50())]
    cut = names.index("layer3.0")  # the tutorial's split: conv1 ... layer2 | layer3 ... fc
    assert RESNET_CHILDREN[TUTORIAL_SPLIT[0]] == "layer3"
    return [names[:cut], names[cut:]]


def _usable(candidates: Sequence[int], batch: int) -> list[int]:
    """Chunk counts whose micro-batches all hold 2+ rows (BatchNorm cannot train on one row at small sizes)."""
    def sizes(c: int) -> list[int]:
        rows = -(-batch // c)
        return [rows] * (batch // rows) + ([batch % rows] if batch % rows else [])
    return [c for c in candidates if min(sizes(c)) >= 2] or [1]


def devmap_systems(devices: Sequence[torch.device], config: HarnessConfig, tune_steps: int = 5) -> dict[str, Builder]:
    """Builders for devmap's pipeline on `devices` (and, on two GPUs, both stages on the first GPU)."""
    sample = torch.randn(config.batch_size, 3, config.image_w, config.image_h, device=devices[0])
    gpus = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
    model = torchvision.models.resnet50(num_classes=config.num_classes)
    if len(gpus) >= 2 and len(gpus) == len(devices):
        dispatch(model, {n: (gpus[0].index if i < TUTORIAL_SPLIT[0] else gpus[1].index)
                         for i, n in enumerate(RESNET_CHILDREN)})
        chunks_guess = 4
        pipeline(model, chunks=chunks_guess, balance="time", sample=sample)
        names = pipeline(model, chunks=1).block_names
        placement = dict(model.hf_device_map)
        two = tune(lambda c: pipeline(model, chunks=c), sample, _usable([2, 3, 4, 5, 6, 8], config.batch_size),
                   steps=tune_steps)
        one = tune(lambda c: pipeline(stages_from_names(model, names, [gpus[0]] * 2), chunks=c), sample,
                   _usable([1, 2, 3, 4], config.batch_size), steps=tune_steps)

        def on_two(devs: Sequence[torch.device], cfg: HarnessConfig) -> nn.Module:
            m = torchvision.models.resnet50(num_classes=cfg.num_classes)
            dispatch(m, placement)
            return _prepared(pipeline(m, chunks=two.best_chunks), devs, cfg)

        def on_one(devs: Sequence[torch.device], cfg: HarnessConfig) -> nn.Module:
            m = torchvision.models.resnet50(num_classes=cfg.num_classes)
            return _prepared(pipeline(stages_from_names(m, names, [devs[0]] * 2), chunks=one.best_chunks), devs, cfg)

        return {f"{LABEL}, 2 GPUs (chunks {two.best_chunks})": on_two,
                f"{LABEL}, 1 GPU (chunks {one.best_chunks})": on_one}
    names = _tutorial_names()
    result = tune(lambda c: pipeline(stages_from_names(model, names, list(devices)[:2]), chunks=c), sample,
                  _usable([1, 2, 4], config.batch_size), steps=1, warmup=0)

    def plain(devs: Sequence[torch.device], cfg: HarnessConfig) -> nn.Module:
        m = torchvision.models.resnet50(num_classes=cfg.num_classes)
        return pipeline(stages_from_names(m, names, list(devs)[:2]), chunks=result.best_chunks)

    return {f"{LABEL} (chunks {result.best_chunks})": plain}


def _prepared(pipe: Pipeline, devs: Sequence[torch.device], cfg: HarnessConfig) -> Pipeline:
    """Capture the graphs in the harness's setup (built with the model, like the tutorial's models)."""
    return pipe.train().prepare(torch.randn(cfg.batch_size, 3, cfg.image_w, cfg.image_h, device=devs[0]))
