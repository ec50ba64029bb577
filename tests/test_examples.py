"""Every script in examples/ runs, at its small size, as a user would run it: so no example rots."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = {
    "toy_two_devices.py": [],
    "plan_70b.py": [],
    "resnet50_pipeline.py": ["--batch-size", "4", "--image-size", "32", "--chunks", "2", "--steps", "2"],
    "llama_save_load_generate.py": ["--out", "{tmp}"],
    "tutorial_comparison.py": ["--out", "{tmp}", "--small"],
    "serve_openai_client.py": ["--out", "{tmp}"],
    "quantized_load_save.py": ["--out", "{tmp}"],
}


def test_every_example_is_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SMALL)


@pytest.mark.parametrize("script", sorted(SMALL))
def test_example_runs(script, tmp_path):
    args = [a.format(tmp=tmp_path) for a in SMALL[script]]
    text = (EXAMPLES / script).read_text()
    assert text.startswith('"""') and len(text.splitlines()) <= 80, "a header docstring, under 80 lines"
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
