"""The code style is checked, not remembered: ruff's pycodestyle errors and pyflakes at 120 columns
(pyproject.toml's `[tool.ruff]`) over the package, its tests, benchmarks and examples; and the front pages stay
readable: README.md within 150 lines with a headline table of short cells, benchmarks/RESULTS.md within 250 (one
current table per workload; history is in git)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "devmap", "tests", "benchmarks",
                             "examples"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_and_the_results_stay_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 150, f"README.md has {len(readme)} lines: keep it within 150 (details belong in docs/)"
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(results) <= 250, f"RESULTS.md has {len(results)} lines: one current table per workload, no history"
    for line in readme:
        if line.startswith("| "):
            for cell in line.strip().strip("|").split("|"):
                words = len(re.sub(r"\]\([^)]*\)", "]", cell).split())  # a link counts as its text
                assert words <= 15, f"README table cell of {words} words (at most 15): {cell.strip()[:60]}"
