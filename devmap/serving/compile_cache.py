"""The compile cache: where a service's compiled steps are kept for its next start, and what happens when an entry
there cannot be read.

torch keeps compiled code in on-disk caches (inductor's FX graph, AOT autograd and kernel caches, Triton's kernel
cache), each entry keyed by its graph (the model's shapes, dtypes, quantization and devices: its config and map), the
card and the releases; devmap keeps its compiled regions beside them (`generation.region_store`: each entry with its
guards, loaded at the next start without dynamo tracing it again). `devmap serve` puts them in one folder
(`--compile-cache`, default ~/.cache/devmap/compile), a sub-folder per release of torch, Triton and transformers, so
that an upgrade starts an empty one and the old one can be deleted whole. Deleting the folder clears the cache.

An entry torch cannot read (a kernel library cut short by a full disk, a file changed by hand) fails the compile that
meets it, naming the file. `compiled_anew` then removes what the failure names inside the cache and compiles again,
with one warning, so the entry is made anew instead of the model losing its compiled steps at every start. A whole
model's compile only: the processes of a split warm up in step (their collectives pair up in order), so one of them
must never start its warm-up again alone. torch itself already skips a cached graph it cannot unpickle (its own
warning) and compiles it again.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger("devmap.serving")

T = TypeVar("T")
RETRIES = 4  # compiles again at most this many times, each after removing the entries the last failure named
_RELEASED = ("torch", "triton", "transformers")  # the releases a cache folder is for
REGIONS = "DEVMAP_REGION_STORE"  # where `use_compile_cache` tells the engine core's process to keep compiled regions


def release_key() -> str:
    """'torch-2.14.1-triton-3.6.0-transformers-5.24.0': the releases the compiled code was made by (from the
    installed packages' metadata, importing none of them)."""
    parts = []
    for package in _RELEASED:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        parts.append(f"{package}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', version)}")
    return "-".join(parts)


def use_compile_cache(folder: str | None) -> Path | None:
    """Point inductor's and Triton's on-disk caches into `folder`'s sub-folder for these releases (None:
    ~/.cache/devmap/compile, unless the environment names inductor's cache already: then it is left as it is and
    None returned), for this process and those it starts; the folder they use."""
    if folder is None and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ[REGIONS] = str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).resolve() / "devmap-regions")
        return None
    root = (Path(folder).expanduser() if folder else
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "devmap", "compile")).resolve()
    here = root / release_key()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(here / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(here / "triton")
    os.environ[REGIONS] = str(here / "regions")
    return here


def keep_regions() -> None:
    """In the engine core's process: keep compiled regions where `use_compile_cache` said (`region_store`)."""
    from ..generation.region_store import keep_regions_in

    keep_regions_in(os.environ.get(REGIONS) or None)


def cache_folders() -> tuple[Path, ...]:
    """The folders this process's compiled code is cached in now (inductor's, Triton's and devmap's regions, where
    set)."""
    return tuple(Path(os.environ[name]).resolve() for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", REGIONS)
                 if os.environ.get(name))


def named_entries(error: BaseException, folders: tuple[Path, ...]) -> list[Path]:
    """The files inside `folders` that `error` (or an error it came from) names, existing ones only."""
    texts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    found: list[Path] = []
    for folder in folders:
        for match in re.finditer(re.escape(str(folder)) + r"[^\s:'\"]*", "\n".join(texts)):
            path = Path(match.group(0).rstrip(".,;)"))
            if path.is_file() and path not in found:
                found.append(path)
    return found


def compiled_anew(compile: Callable[[], T], before_again: Callable[[], None] = lambda: None,
                  folders: Callable[[], tuple[Path, ...]] = cache_folders) -> T:
    """`compile()`, made again where it fails on entries of the compile cache it names: those files are removed,
    `before_again()` undoes what the failed attempt left (its steps' graphs), and it runs once more, up to RETRIES
    times, with one warning. Any other failure is raised as it came."""
    removed: list[Path] = []
    while True:
        try:
            result = compile()
        except Exception as exc:
            entries = named_entries(exc, folders()) if len(removed) < RETRIES else []
            if not entries:
                raise
            for entry in entries:
                entry.unlink(missing_ok=True)
            removed += entries
            before_again()
            continue
        if removed:
            reason = ", ".join(str(path) for path in removed)
            log.warning("the compile cache held entries torch could not read (%s): removed, and compiled anew", reason)
        return result
