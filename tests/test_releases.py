"""The tested range of each library: stated once in pyproject.toml and devmap.releases, and a release outside it
refused with one line (package, version, range) by the CLI (exit 2) and the library, before any work."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from devmap.releases import SUPPORTED, Release, releases

ROOT = Path(__file__).resolve().parents[1]


def pyproject_ranges() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    ranges: dict[str, str] = {}
    for line in lines:
        requirement = Requirement(line)
        ranges.setdefault(requirement.name, str(requirement.specifier))
        assert ranges[requirement.name] == str(requirement.specifier), f"{requirement.name} stated twice, differently"
    return ranges


def test_pyproject_states_the_ranges_devmap_checks():
    stated = pyproject_ranges()
    for package, (tested, _) in SUPPORTED.items():
        assert str(Requirement(f"{package}{tested}").specifier) == stated[package], package


def test_the_oldest_releases_ci_pins_are_the_lower_bounds():
    pins = {}
    for line in (ROOT / ".ci" / "oldest-releases.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pins[requirement.name] = str(requirement.specifier).removeprefix("==")
    for package, spec in pyproject_ranges().items():
        lower = [s.version for s in Requirement(f"{package}{spec}").specifier if s.operator == ">="]
        if package == "bitsandbytes":  # GPU only: not installed on CI
            continue
        assert package in pins, f"{package} has no oldest release pinned in .ci/oldest-releases.txt"
        assert lower and Requirement(f"{package}{spec}").specifier.contains(pins[package]), package
        floor, pin = Version(lower[0]).release, Version(pins[package]).release
        assert pin[:len(floor)] == floor, \
            f"{package}: CI's oldest leg pins {pins[package]}, the range starts at {lower[0]}"


def test_installed_releases_are_inside_their_ranges():
    outside = [r.problem() for r in releases() if not r.supported]
    assert not outside, outside


@pytest.mark.parametrize("version, ok", [("2.11.0+cu130", True), ("2.14.1", True), ("2.14.0a0+nv25.10", True),
                                         ("2.15.0", False), ("2.10.1", False), ("not-a-version", False)])
def test_local_and_pre_release_versions_of_torch(version, ok):
    assert Release("torch", version, SUPPORTED["torch"][0], True).supported is ok


def test_an_optional_library_may_be_missing_and_a_required_one_may_not():
    assert Release("bitsandbytes", None, ">=0.50,<0.51", False).supported
    missing = Release("transformers", None, ">=5.17,<5.25", True)
    assert not missing.supported and "not installed" in missing.problem()


def fake_release(tmp_path: Path, package: str, version: str) -> dict:
    """An environment in which package metadata says `package` is at `version` (the real code still imports)."""
    info = tmp_path / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    env = {k: v for k, v in os.environ.items() if k != "DEVMAP_ALLOW_UNSUPPORTED"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_a_release_just_past_the_range_is_one_line_and_exit_2(tmp_path):
    # transformers 5.24 renamed the decoder layer's cache keyword and the mask function's argument: a release devmap
    # was never run on must be refused up front, not fail with a TypeError deep inside generation
    env = fake_release(tmp_path, "transformers", "5.25.0")
    for args in (["plan", "llama-tiny"], ["env"]):
        result = subprocess.run([sys.executable, "-m", "devmap", *args], env=env, capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "transformers 5.25.0" in lines[0] and "transformers>=5.17,<5.25" in lines[0]
    assert "OUTSIDE" in result.stdout  # devmap env shows the table first


def test_the_library_refuses_before_any_work_and_the_variable_lets_it_run(tmp_path):
    env = fake_release(tmp_path, "accelerate", "1.16.0")
    code = "import devmap\ntry:\n    devmap.plan\nexcept devmap.DevmapError as e:\n    print(type(e).__name__, e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.startswith("UnsupportedReleaseError accelerate 1.16.0 is outside"), out.stdout + out.stderr
    allowed = subprocess.run([sys.executable, "-m", "devmap", "plan", "llama-tiny", "--json"],
                             env={**env, "DEVMAP_ALLOW_UNSUPPORTED": "1"}, capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr
    assert "untested releases" in allowed.stderr


def test_torchaos_import_warning_under_newer_torch_is_filtered_and_nothing_else():
    import logging

    from devmap.releases import KNOWN_NOISE, require_supported

    require_supported()
    logger = logging.getLogger(KNOWN_NOISE[0])

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)

    noise = record(f"<enum 'KernelPreference'> is an Enum subclass ... {KNOWN_NOISE[1]} in a future release.")
    assert not logger.filter(noise) and logger.filter(record("another warning"))
    require_supported()  # installed once
    assert sum(type(f).__name__ == "_KnownNoise" for f in logger.filters) == 1
