"""The releases of each library devmap was tested on, and the check that refuses others before any work starts.

`SUPPORTED` is the range the test suite passed on at both ends (CI runs it against the newest releases pip
resolves and against `.ci/oldest-releases.txt`). Where devmap touches a library's private or version-dependent
API (listed in `devmap.compat`) the range has an upper bound, as serving stacks pin theirs: a release past it is
refused with one line naming the package, its version and the range, instead of failing deep inside a call.
`pyproject.toml` states the same ranges; a test keeps the two equal.

Set DEVMAP_ALLOW_UNSUPPORTED=1 to run on other releases anyway (a warning is logged once): for trying a new
release before devmap's range moves.

This module imports neither torch nor transformers: it reads installed versions from package metadata, so the
check costs milliseconds and `devmap --help` stays instant.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import UsageError

ALLOW_VARIABLE = "DEVMAP_ALLOW_UNSUPPORTED"

# package -> (tested range, whether it must be installed). Upper bounds where devmap uses internals.
SUPPORTED: dict[str, tuple[str, bool]] = {
    "torch": (">=2.11,<2.15", True),
    "torchvision": (">=0.26,<0.30", True),
    "transformers": (">=5.17,<5.25", True),
    "accelerate": (">=1.15,<1.16", True),
    "safetensors": (">=0.8", True),
    "torchao": (">=0.18,<0.19", False),
    "bitsandbytes": (">=0.50,<0.51", False),
}

_log = logging.getLogger(__name__)


class UnsupportedReleaseError(UsageError):
    """An installed library's release is outside the range devmap was tested on."""


@dataclass(frozen=True)
class Release:
    """One library as installed here, against its tested range."""

    package: str
    version: str | None  # None: not installed
    tested: str
    required: bool

    @property
    def supported(self) -> bool:
        if self.version is None:
            return not self.required
        try:
            return SpecifierSet(self.tested).contains(Version(self.version), prereleases=True)
        except InvalidVersion:
            return False

    def problem(self) -> str:
        if self.version is None:
            return f"{self.package} is not installed; devmap needs {self.package}{self.tested} (pip install -e .)"
        return (f"{self.package} {self.version} is outside the range devmap is tested on "
                f"({self.package}{self.tested}); install one inside it, e.g. pip install '{self.package}{self.tested}' "
                f"(or set {ALLOW_VARIABLE}=1 to run anyway)")


def installed(package: str) -> str | None:
    """The installed version of `package` (None if it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def releases() -> list[Release]:
    """Every library of `SUPPORTED`, as installed now."""
    return [Release(name, installed(name), tested, required) for name, (tested, required) in SUPPORTED.items()]


@functools.lru_cache(maxsize=1)
def _checked() -> tuple[str, ...]:
    return tuple(r.problem() for r in releases() if not r.supported)


KNOWN_NOISE = ("torch.utils._pytree", "Calling register_constant() on Enum subclasses is deprecated")
"""A log warning of torch 2.14 that torchao 0.18 triggers twice at import (it registers two enums as pytree
constants), and transformers imports torchao whenever it is installed: filtered by its text from that logger alone."""


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return KNOWN_NOISE[1] not in record.getMessage()


def quiet_known_noise() -> None:
    """Drop KNOWN_NOISE's warning (once installed, a no-op)."""
    logger = logging.getLogger(KNOWN_NOISE[0])
    if not any(isinstance(f, _KnownNoise) for f in logger.filters):
        logger.addFilter(_KnownNoise())


def require_supported() -> None:
    """Raise UnsupportedReleaseError (one line: package, version, range) if a library is outside its tested range;
    with DEVMAP_ALLOW_UNSUPPORTED=1 log a warning once instead. Quiets KNOWN_NOISE first."""
    quiet_known_noise()
    problems = _checked()
    if not problems:
        return
    if os.environ.get(ALLOW_VARIABLE, "") not in ("", "0"):
        if not getattr(require_supported, "warned", False):
            require_supported.warned = True  # type: ignore[attr-defined]
            _log.warning("running on untested releases: %s", "; ".join(problems))
        return
    raise UnsupportedReleaseError(problems[0] + (f" (and {len(problems) - 1} more: run 'devmap env')"
                                                 if len(problems) > 1 else ""))
