"""The code style is checked, not remembered: ruff's pycodestyle errors and pyflakes at 120 columns
(pyproject.toml's `[tool.ruff]`) over the package, its tests, benchmarks and examples."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "devmap", "tests", "benchmarks",
                             "examples"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
