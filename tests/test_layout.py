"""The tree shows the architecture: imports flow one way between sub-packages, no cycles, small modules, and a
light `import devmap`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "devmap"
# A sub-package may import those of lower rank and itself only (cli -> serving -> comparison/generation/
# distributed -> pipelining -> loading -> planning/kernels -> compat -> releases/bytecode -> errors); peers of one
# rank never import each other.
RANK = {"errors": -2, "releases": -1, "bytecode": -1, "compat": 0, "testing": 0, "planning": 1, "kernels": 1,
        "loading": 2, "pipelining": 3,
        "generation": 4, "comparison": 4, "distributed": 4, "serving": 5, "cli": 6}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every devmap module `path` imports, at the top or inside a function (a lazy import is still a dependency)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("devmap"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("devmap"):
                continue
            found.add(target)
            for alias in node.names:  # `from . import hardware` names a module
                if (ROOT.parent / Path(*f"{target}.{alias.name}".split("."))).with_suffix(".py").exists():
                    found.add(f"{target}.{alias.name}")
    found.discard(name)
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}
GRAPH = {name: {t for t in imports_of(path) if t in MODULES} for name, path in MODULES.items()}


def area(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_imports_flow_one_way_between_sub_packages():
    wrong = []
    for module, targets in GRAPH.items():
        here = area(module)
        if here is None or here == "__main__":
            continue
        for target in targets:
            there = area(target)
            if there is None or there == here:
                continue
            if RANK[there] >= RANK[here]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the flow cli -> comparison/generation -> pipelining -> loading -> planning: " \
        + "; ".join(sorted(wrong))


MOST_LINES = 400  # a tripwire for a module that grew past one concept, not a size to split to: split by concept


def test_every_module_is_small_and_says_what_it_is():
    for name, path in MODULES.items():
        text = path.read_text()
        lines = len(text.splitlines())
        assert lines <= MOST_LINES, f"{name} has {lines} lines (at most {MOST_LINES}): split it by concept"
        assert ast.get_docstring(ast.parse(text)), f"{name} has no module docstring"


def test_import_devmap_stays_light():
    code = ("import sys, devmap; heavy = [m for m in ('torch', 'transformers', 'torchvision', 'accelerate') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_planning_does_not_import_transformers_model_code_until_asked():
    code = ("import sys, devmap.planning.memory, devmap.loading.checkpoint; "
            "assert 'transformers' not in sys.modules and 'torchvision' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
