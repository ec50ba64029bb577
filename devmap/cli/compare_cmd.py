"""`devmap compare`: the model-parallel tutorial's timing experiment as one command, with its plots."""

from __future__ import annotations

import click

from .output import echo_json, table

_SPLIT_SIZES = "1,3,5,8,10,12,20,40,60"


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """"1,3,5" -> (1, 3, 5); anything else is a one-line UsageError."""
    from devmap.errors import UsageError

    items = [t.strip() for t in text.split(",")]
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise UsageError(f"{what}: {item!r} is not an integer (expected e.g. {_SPLIT_SIZES})") from None
        if value < 1:
            raise UsageError(f"{what}: {value} is not a positive integer")
        values.append(value)
    return tuple(values)


def describe_ratio(ratio: float) -> str:
    """Time ratio to Single GPU -> "1.11x faster" / "1.18x slower" / "same"."""
    if ratio != ratio or ratio <= 0:
        return "-"
    if round(ratio, 2) == 1:
        return "same"
    return f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower"


@click.command()
@click.option("--devices", default=None, help="Comma-separated devices, e.g. cuda:0,cuda:1 (default: the first two "
              "GPUs) or cpu,cpu for a smoke run.")
@click.option("--batch-size", type=int, default=120, show_default=True, help="Images per batch.")
@click.option("--image-size", type=int, default=128, show_default=True, help="Image width and height.")
@click.option("--num-batches", type=int, default=3, show_default=True, help="Batches per train() call.")
@click.option("--num-classes", type=int, default=1000, show_default=True, help="ResNet50 output classes.")
@click.option("--repeat", type=int, default=10, show_default=True, help="timeit repeats per system.")
@click.option("--split-sizes", default=_SPLIT_SIZES, show_default=True, help="Pipeline split sizes to sweep.")
@click.option("--pipeline-split-size", type=int, default=20, show_default=True,
              help="Split size of the 'Pipelining Model Parallel' system.")
@click.option("--warmup", type=int, default=0, show_default=True,
              help="Untimed train() calls per system first (the tutorial has none, so its first timed run "
              "includes CUDA start-up; 1 removes that).")
@click.option("--device-map", "device_map", default=None,
              help="Place ResNet50's children with a planner strategy (auto, balanced, balanced_low_0, sequential) "
              "instead of the tutorial's split after layer2.")
@click.option("--out", "out_dir", default="compare-out", show_default=True, type=click.Path(file_okay=False),
              help="Folder for results.json and the PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print results.json instead of the table (no progress bar).")
@click.option("--no-devmap", "no_devmap", is_flag=True, help="Leave devmap's own pipeline out of the comparison.")
@click.option("--toy", is_flag=True, help="Time the tutorial's ToyModel (Linear 10->10, relu, Linear 10->5) instead.")
def compare(devices: str | None, batch_size: int, image_size: int, num_batches: int, num_classes: int, repeat: int,
            split_sizes: str, pipeline_split_size: int, warmup: int, device_map: str | None, out_dir: str,
            as_json: bool, no_devmap: bool, toy: bool) -> None:
    """Time ResNet50 on one device, split over two (Model Parallel), and pipelined, as the PyTorch
    model-parallel tutorial does, then sweep the pipeline split size.

    Writes OUT/results.json, mp_vs_rn.png, mp_vs_rn_vs_pp.png, split_size_tradeoff.png and, with devmap's
    pipeline in the comparison (the default), mp_vs_rn_vs_pp_vs_devmap.png.
    Defaults are the tutorial's: 3 batches of 120 images of 3x128x128, timeit repeat=10, number=1.
    """
    import sys

    from tqdm import tqdm

    from devmap.errors import UsageError
    from devmap.comparison.plots import save_results, write_plots
    from devmap.comparison.timing import HarnessConfig, check_micro_batches, parse_devices, run_comparison, total_runs

    config = HarnessConfig(num_batches=num_batches, batch_size=batch_size, image_w=image_size, image_h=image_size,
                           num_classes=num_classes, repeat=repeat, pipeline_split_size=pipeline_split_size,
                           warmup=warmup, split_sizes=parse_int_list(split_sizes, "--split-sizes"))
    devs = parse_devices(devices)
    placement = None
    if toy and device_map is not None:
        raise UsageError("--device-map applies to ResNet50, not to --toy")
    if not toy:  # every check before the progress bar starts, so errors stay one line
        from devmap.comparison.tutorial_models import RESNET_CHILDREN, resolve_placement

        check_micro_batches(config)
        placement = dict(zip(RESNET_CHILDREN, resolve_placement(devs, device_map)))
    extra = None
    if not toy and not no_devmap:  # tuned once here, outside the timed runs
        from devmap.comparison.compare_systems import devmap_systems

        extra = devmap_systems(devs, config)
    with tqdm(total=total_runs(config, extra), desc="compare", unit="run", file=sys.stderr,
              disable=as_json or not sys.stderr.isatty(), leave=False) as bar:
        result = run_comparison(devs, config, toy=toy, device_map=placement, extra_systems=extra,
                                progress=lambda: bar.update(1))
    save_results(result, out_dir)
    write_plots(result, out_dir)
    if as_json:
        echo_json(result.to_dict())
        return
    click.echo(render_comparison(result))
    click.echo(f"\nWrote results.json and plots to {out_dir}")


def render_comparison(result) -> str:  # type: ignore[no-untyped-def]
    """The systems table, the split-size sweep and the best split size of a ComparisonResult."""
    from devmap.comparison.timing import SINGLE_GPU

    cfg = result.config
    what = "ToyModel" if result.model == "toy" else (
        f"ResNet50 · {cfg.num_batches} batch{'es' if cfg.num_batches != 1 else ''} of {cfg.batch_size} x "
        f"3x{cfg.image_w}x{cfg.image_h}")
    names = "; ".join(f"{d}: {result.device_names[d]}" for d in dict.fromkeys(result.devices))
    devices = f"{', '.join(result.devices)} ({names})"
    stages: list[list] = []
    for name, index in result.placement.items():
        if stages and stages[-1][2] == index:
            stages[-1][1] = name
        else:
            stages.append([name, name, index])
    layout = " | ".join(f"{a}{' … ' + b if a != b else ''} → {result.devices[i]} (#{i})" for a, b, i in stages)
    warm = f" · warmup {cfg.warmup}" if cfg.warmup else ""
    lines = [f"{what} · repeat {cfg.repeat}{warm} · torch {result.torch_version}", f"Devices: {devices}",
             f"Model Parallel stages: {layout}", ""]
    rows = [[label, f"{t.mean:.3f} ± {t.std:.3f}",
             "baseline" if label == SINGLE_GPU else describe_ratio(result.ratios[label])]
            for label, t in result.systems.items()]
    lines.append(table(["system", "seconds (mean ± std)", "vs Single GPU"], rows, right=(1,)))
    single = result.systems[SINGLE_GPU].mean
    sweep = [[p["split_size"], f"{p['mean']:.3f} ± {p['std']:.3f}", describe_ratio(p["mean"] / single)]
             for p in result.sweep]
    lines += ["", table(["split size", "seconds (mean ± std)", "vs Single GPU"], sweep, right=(0, 1))]
    best = next(p for p in result.sweep if p["split_size"] == result.best_split_size)
    ratio = describe_ratio(best["mean"] / single)
    versus = "as fast as Single GPU" if ratio == "same" else f"{ratio} than Single GPU"
    lines.append(f"\nBest split size: {best['split_size']} ({best['mean']:.3f} s, {versus})")
    if not cfg.warmup and any(d.startswith("cuda") for d in result.devices):
        lines.append("Note: no warm-up, as in the tutorial: the first timed run includes CUDA start-up; "
                     "--warmup 1 leaves it out")
    return "\n".join(lines)
