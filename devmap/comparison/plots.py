"""The comparison's files: the tutorial's PNG plots (drawn with Agg) and results.json, all written atomically."""

from __future__ import annotations

import io
import json
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Sequence

import numpy as np

from .timing import MODEL_PARALLEL, PIPELINE, SINGLE_GPU, ComparisonResult

MP_VS_RN = "mp_vs_rn.png"
MP_VS_RN_VS_PP = "mp_vs_rn_vs_pp.png"
SPLIT_SIZE_TRADEOFF = "split_size_tradeoff.png"
WITH_DEVMAP = "mp_vs_rn_vs_pp_vs_devmap.png"
YLABEL = "ResNet50 Execution Time (Second)"


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then os.replace it into place (no half-written files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def save_results(result: ComparisonResult, out_dir: str | Path) -> Path:
    """Write OUT_DIR/results.json (atomically) and return its path."""
    return write_atomic(Path(out_dir) / "results.json", (json.dumps(result.to_dict(), indent=2) + "\n").encode())


def _figure():  # type: ignore[no-untyped-def]
    # A Figure on an Agg canvas: no pyplot, so the caller's matplotlib backend and state are left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig, path: str | Path) -> Path:  # type: ignore[no-untyped-def]
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return write_atomic(path, buffer.getvalue())


def plot_bars(means: Sequence[float], stds: Sequence[float], labels: Sequence[str], path: str | Path,
              ylabel: str = YLABEL) -> Path:
    """The tutorial's plot(): one bar per system with its std as a red error bar."""
    fig, ax = _figure()
    ax.bar(np.arange(len(means)), means, yerr=stds, align="center", alpha=0.5, ecolor="red", capsize=10, width=0.6)
    ax.set_ylabel(ylabel)
    ax.set_xticks(np.arange(len(means)))
    # long labels (devmap's systems) wrap instead of running into their neighbours
    ax.set_xticklabels([textwrap.fill(label, 12) for label in labels], fontsize=10 if len(labels) <= 3 else 8)
    ax.yaxis.grid(True)
    fig.tight_layout()
    return _save(fig, path)


def plot_split_sizes(split_sizes: Sequence[int], means: Sequence[float], stds: Sequence[float], path: str | Path,
                     ylabel: str = YLABEL) -> Path:
    """The tutorial's split-size trade-off: the mean line with red error bars at each split size."""
    fig, ax = _figure()
    ax.plot(split_sizes, means)
    ax.errorbar(split_sizes, means, yerr=stds, ecolor="red", fmt="ro")
    ax.set_ylabel(ylabel)
    ax.set_xlabel("Pipeline Split Size")
    ax.set_xticks(split_sizes)
    ax.yaxis.grid(True)
    fig.tight_layout()
    return _save(fig, path)


def write_plots(result: ComparisonResult, out_dir: str | Path) -> list[Path]:
    """mp_vs_rn.png, mp_vs_rn_vs_pp.png, split_size_tradeoff.png, and mp_vs_rn_vs_pp_vs_devmap.png when
    the result has extra systems (all of them are drawn after the tutorial's three)."""
    out = Path(out_dir)
    ylabel = YLABEL if result.model == "resnet50" else "ToyModel Execution Time (Second)"

    def bars(labels: Sequence[str], name: str) -> Path:
        timings = [result.systems[label] for label in labels]
        return plot_bars([t.mean for t in timings], [t.std for t in timings], labels, out / name, ylabel)

    written = [bars([MODEL_PARALLEL, SINGLE_GPU], MP_VS_RN),
               bars([MODEL_PARALLEL, SINGLE_GPU, PIPELINE], MP_VS_RN_VS_PP)]
    sweep = result.sweep
    written.append(plot_split_sizes([p["split_size"] for p in sweep], [p["mean"] for p in sweep],
                                    [p["std"] for p in sweep], out / SPLIT_SIZE_TRADEOFF, ylabel))
    if result.extra_systems:
        written.append(bars([MODEL_PARALLEL, SINGLE_GPU, PIPELINE, *result.extra_systems], WITH_DEVMAP))
    return written
