"""Compiled regions kept on disk: each region's compiled entries saved once, loaded by later processes untraced.

torch's on-disk caches (inductor's FX graph and AOT autograd caches) spare a restart inductor's work, not dynamo's:
every process traces each region again and builds its guards anew, most of a warm restart's compile (docs/serving.md),
and a compile beside serving shares the interpreter with the serving thread all that while.
With a store (`keep_regions_in`, which `devmap serve` points inside its compile cache), a dynamic region compiles each
entry ahead of time instead (one per kind of call: a decode step, a step carrying a pack, a join's prefill; its graph,
guards and inductor's code together: `compat.ahead_of_time`), saves it, and the next process loads its entries at the
region's first call and runs the first one whose guards accept the call. Where none does, it compiles a new entry and
saves that too, once it has read it back (torch 2.11 saves some guards it cannot load: an entry whose guards read a
function it cannot name). A region that cannot be compiled whole (a graph break), or whose entry does not read back,
compiles through dynamo from then on, as without a store.

Guards on globals are not kept in an entry: what a region reads of devmap's modules, transformers' or the card is
fixed in its graph, so entries are filed under the region, a digest of devmap's sources, the torch and transformers
releases and the card. Guards on torch's global state are kept (grad mode, default dtype, the thread count): a
process that differs there compiles entries of its own beside the others. An entry that cannot be read (cut short,
or written by another torch) is skipped with one warning and removed, and compiled again where a call needs it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

from ..compat import ahead_of_time, ahead_of_time_possible, entry_accepts, entry_bytes, entry_from_bytes
from .graphed_step import captures_paused, device_work_paused

log = logging.getLogger("devmap.generation")

SUFFIX = ".entry"

_folder: Path | None = None
_lock = threading.RLock()  # the store's regions, loads and compiles (one compile at a time, in any thread)


def keep_regions_in(folder: str | os.PathLike[str] | None) -> None:
    """Keep dynamic regions' compiled entries in `folder` (made where missing) from now on, in this process; None:
    compile them through dynamo, kept nowhere (the default)."""
    global _folder
    with _lock:
        _folder = Path(folder) if folder is not None else None
        _regions.clear()


def store_folder() -> Path | None:
    """The folder regions are kept in now (None: none)."""
    return _folder


@dataclass
class RegionTotals:
    """What the store did in this process: entries compiled (and saved) and loaded, and the seconds each took."""

    compiled: int = 0
    loaded: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


_totals = RegionTotals()


def region_totals() -> RegionTotals:
    """A copy of this process's totals so far (a difference of two gives what ran between)."""
    with _lock:
        return RegionTotals(**vars(_totals))


class _Region:
    """One region's entries for one card: those loaded from its folder, then those compiled here."""

    def __init__(self, function: Callable[..., Any], folder: Path) -> None:
        self.function, self.folder = function, folder
        self.entries: tuple[Any, ...] = ()
        self.whole = True  # False once it could not be compiled whole: dynamo compiles its calls from then on
        self._load()

    def _load(self) -> None:
        started, loaded = time.perf_counter(), []
        for path in sorted(self.folder.glob(f"*{SUFFIX}")) if self.folder.is_dir() else ():
            try:
                loaded.append(entry_from_bytes(path.read_bytes(), self.function))
            except Exception as exc:  # noqa: BLE001 - whatever a stale or cut entry raises, it is only skipped
                log.warning("a compiled region in the store could not be read (%s: %s): removed, compiled again "
                            "where needed", path, _first_line(exc))
                path.unlink(missing_ok=True)
        self.entries = tuple(loaded)
        _totals.loaded += len(loaded)
        _totals.load_seconds += time.perf_counter() - started

    def accepting(self, args: tuple[Any, ...]) -> Any:
        """The first entry whose guards accept `args`, or None."""
        for entry in self.entries:
            if entry_accepts(entry, args):
                return entry
        return None

    def compile(self, backend: str, args: tuple[Any, ...]) -> Any:
        """A new entry for `args`, saved (None where the region cannot be compiled whole: `whole` turns False)."""
        started = time.perf_counter()
        try:
            entry = ahead_of_time(self.function, backend, args)
        except Exception as exc:  # noqa: BLE001 - a graph break, an unsupported guard: dynamo compiles it instead
            self.whole = False
            log.info("%s: compiled through dynamo, not kept in the store (%s)", self.function.__name__,
                     _first_line(exc))
            return None
        self.entries = (*self.entries, entry)
        _totals.compiled += 1
        try:
            data = entry_bytes(entry)
            entry_from_bytes(data, self.function)  # what a later process would read: kept only if it loads
        except Exception as exc:  # noqa: BLE001 - it still serves this process; later calls go through dynamo
            self.whole = False
            log.info("%s: compiled through dynamo from now on, not kept in the store (%s)", self.function.__name__,
                     _first_line(exc))
        else:
            try:
                self._save(data)
            except OSError as exc:  # a full or read-only disk: it still serves this process
                log.warning("%s: a compiled entry could not be kept in the store (%s)", self.function.__name__,
                            _first_line(exc))
        seconds = time.perf_counter() - started
        _totals.compile_seconds += seconds
        log.info("%s: a compiled entry made for sizes %s in %.1f s (%d kept for it)", self.function.__name__,
                 _sizes(args), seconds, len(self.entries))
        return entry

    def _save(self, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{hashlib.sha256(data).hexdigest()[:24]}{SUFFIX}"
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".part")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, target)  # whole or not at all: a reader never meets half an entry
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


_regions: dict[tuple[str, str], _Region] = {}


def stored_call(function: Callable[..., Any], backend: str, args: tuple[Any, ...],
                fallback: Callable[..., Any]) -> Any:
    """`function(*args)` run by its stored entry (loaded, or compiled and saved now), or by `fallback` (dynamo's
    compile) where the store cannot hold it. Called with the tensors' dynamic dimensions marked and inside
    `tracing_lifted` (a compile beside serving): a compile here pauses captures, as the backend does for dynamo,
    and running an entry is device work (`device_work_paused`)."""
    region = _region(function, args)
    if region is None:
        return fallback(*args)
    entry = region.accepting(args)
    if entry is None and region.whole:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{function.__name__} would compile inside a CUDA-graph capture")
        with captures_paused(), _lock:  # in this order: no capture is in flight while the lock is held
            entry = region.accepting(args)  # another thread may have compiled it meanwhile
            if entry is None:
                entry = region.compile(backend, args)
    if entry is None:
        return fallback(*args)
    with device_work_paused():
        return entry(*args)


def _region(function: Callable[..., Any], args: tuple[Any, ...]) -> _Region | None:
    folder = _folder
    if folder is None or not ahead_of_time_possible():
        return None
    name = f"{function.__module__}.{function.__qualname__}"
    key = (name, _card(args))
    region = _regions.get(key)
    if region is None:
        with _lock:
            region = _regions.get(key)
            if region is None:
                region = _regions[key] = _Region(function, folder / name / _file_key(key[1]))
    return region


def _card(args: tuple[Any, ...]) -> str:
    """The card the call runs on: that of its first tensor on a GPU ("cpu" without one)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_cuda:
            index = arg.device.index if arg.device.index is not None else torch.cuda.current_device()
            return _card_name(index)
    return "cpu"


@functools.cache
def _card_name(index: int) -> str:
    """How the store names the GPU of `index`: its name, compute capability and SM count."""
    props = torch.cuda.get_device_properties(index)
    return f"{props.name} sm{props.major}{props.minor} {props.multi_processor_count} SMs"


@functools.cache
def _sources_digest() -> str:
    """A digest of devmap's sources, read once per process."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _file_key(card: str) -> str:
    """A digest of what an entry's code was made from besides its guards: devmap's sources, the releases, the card."""
    releases = []
    for package in ("torch", "triton", "transformers"):
        try:
            releases.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    key = "\n".join([_sources_digest(), *releases, card])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def entries_key(index: int) -> str:
    """What the entries made on the GPU of `index` are filed under besides their region: a digest of devmap's sources,
    the releases and that card; where it changes, no entry kept before serves."""
    return _file_key(_card_name(index))


def _sizes(args: tuple[Any, ...]) -> list[tuple[int, ...]]:
    """The sizes of the tensors among `args` (what a log line says of a call)."""
    return [tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
