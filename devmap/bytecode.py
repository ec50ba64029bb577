"""Whether the large packages a start imports (torch, transformers) have bytecode that Python can read.

pip writes each module's bytecode at install, and Python writes what is missing on first import. An image built
with `pip install --no-compile` (or with the bytecode stripped) and run with PYTHONDONTWRITEBYTECODE=1, or from a
read-only site-packages, has neither: every process then compiles those packages' sources again, which makes every
`devmap serve` start, restart and shard process seconds slower (docs/serving.md, "Where a start's time goes", has
the figures). `devmap serve` and `devmap env` name the packages and the one command that writes their bytecode.

Nothing here imports the packages: their files are found from their import specs.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# a package, and one module of it every start imports besides its __init__ (bytecode is checked for both)
CHECKED = {"torch": "_tensor.py", "transformers": "modeling_utils.py"}


def _recompiled(package: str, module: str) -> str | None:
    """The folder `package` is installed in, if Python compiles `module` of it from source in every process (no
    bytecode for it, and none can be written: PYTHONDONTWRITEBYTECODE, or a folder Python cannot write to); else
    None (also when it is not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    folder = os.path.dirname(spec.origin)
    sources = [spec.origin, os.path.join(folder, module)]
    try:
        missing = [importlib.util.cache_from_source(s) for s in sources if os.path.exists(s)]
    except NotImplementedError:  # an interpreter without bytecode caching
        return None
    missing = [cached for cached in missing if not os.path.exists(cached)]
    if not missing:
        return None
    nearest = os.path.dirname(missing[0])  # Python makes the missing folders of a cache path where it may write
    while not os.path.isdir(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if sys.dont_write_bytecode or not os.access(nearest, os.W_OK):
        return os.path.dirname(folder)
    return None


def recompiled_packages() -> dict[str, str]:
    """The packages of `CHECKED` whose sources every process compiles again (see the module's docstring), each with
    the folder it is installed in."""
    found = {package: _recompiled(package, module) for package, module in CHECKED.items()}
    return {package: folder for package, folder in found.items() if folder is not None}


def bytecode_advice(packages: dict[str, str]) -> str:
    """One line naming `packages` (from `recompiled_packages`) and the command that writes their bytecode once."""
    names, folders = ", ".join(packages), " ".join(dict.fromkeys(packages.values()))
    verb = "has" if len(packages) == 1 else "have"
    return (f"{names} {verb} no bytecode and Python may not write it (PYTHONDONTWRITEBYTECODE or a read-only folder): "
            f"every process compiles their sources again, seconds of each start; write it once with: "
            f"{os.path.basename(sys.executable)} -m compileall -q {folders}")
