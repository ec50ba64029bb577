"""Options shared by the commands that plan a placement (plan, load)."""

from __future__ import annotations

from typing import Any, Callable

import click

STRATEGY_HELP = ("auto, balanced, balanced_low_0 or sequential (GPUs first, then cpu, then disk); one device for the "
                 "whole model (cpu, cuda:1, 0); or a JSON file {module: device} (e.g. the output of plan --json).")


DEVICE_MAP = click.option("--device-map", "device_map", default="auto", show_default=True, help=STRATEGY_HELP)


def placement_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--device-map, --gpus, --gpu-memory, --max-memory, --dtype."""
    options = [
        DEVICE_MAP,
        click.option("--gpus", type=int, default=None, help="Number of GPUs (simulated with --gpu-memory)."),
        click.option("--gpu-memory", default=None, help="Memory of each simulated GPU, e.g. 80GiB."),
        click.option(
            "--max-memory",
            default=None,
            help="Budget per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB,disk=200GB (sizes in B/KB/MB/GB/TB, "
            "KiB/MiB/GiB/TiB or % of the device).",
        ),
        click.option("--dtype", default=None, help="float32, float16, bfloat16 (also fp32, fp16, bf16) or auto."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def load_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--device-map, --max-memory, --dtype, --quantize (real devices: loading never simulates GPUs)."""
    options = [
        DEVICE_MAP,
        click.option("--max-memory", default=None,
                     help="Budget per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB,disk=200GB."),
        click.option("--dtype", default=None,
                     help="float32, float16, bfloat16, or auto (the checkpoint's; weights are cast on load)."),
        click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "nf4", "fp8"],
                                                                     case_sensitive=False),
                     help="Quantize the blocks' Linear layers as they load (int8, int4, fp8: torchao; nf4: "
                          "bitsandbytes; int4 and nf4 on GPUs only, fp8 on GPUs with FP8 tensor cores: compute "
                          "capability 8.9 and up); the dtype defaults to bfloat16."),
    ]
    for option in reversed(options):
        func = option(func)
    return func
