"""A checkpoint directory appears whole or not at all: the destination is checked first, files are written into
a temporary directory beside it (with the disk's free space checked), and the finished directory is renamed into
place (an existing one moved aside, then removed).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..planning.memory import format_bytes


def check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is a file; choose a directory to write the checkpoint into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{out} exists and is not empty; pass --overwrite or choose another directory")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write into {ancestor}: it is not a writable directory; choose another directory")


def make_temp(out: Path, total: int) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if free < total:
            raise UsageError(f"{out.parent} has {format_bytes(free)} free and the checkpoint needs "
                             f"{format_bytes(total)}; choose another directory")
        for _ in range(100):
            tmp = out.parent / f".{out.name}.devmap-tmp-{os.getpid()}-{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                tmp.mkdir()  # unlike mkdtemp, honours the umask: the renamed directory gets normal permissions
                return tmp
        raise FileExistsError(f"no free temporary name next to {out}")
    except OSError as exc:
        raise UsageError(f"cannot write into {out.parent}: {exc.strerror or exc}; choose another directory") from None


def umask_now() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def install(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory to `out`; an existing `out` is moved aside, then removed."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.devmap-old-", dir=out.parent))
    os.replace(out, old / "previous")
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old / "previous", out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
