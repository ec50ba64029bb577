"""A package whose sources every process compiles again (no bytecode, none writable) is named, with the command that
writes its bytecode, by `devmap env` and `devmap serve`; one with bytecode, or where Python may write it, is not."""

import compileall
import sys

import pytest

from devmap import bytecode
from devmap.planning import hardware


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An importable package `fakepkg` in tmp_path (its __init__ and one module), without bytecode, checked in
    place of torch and transformers."""
    folder = tmp_path / "fakepkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "core.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bytecode, "CHECKED", {"fakepkg": "core.py", "not_installed_anywhere": "x.py"})
    monkeypatch.setattr(sys, "pycache_prefix", None)
    return tmp_path


def test_a_package_without_bytecode_that_python_may_not_write_is_named(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    found = bytecode.recompiled_packages()
    assert found == {"fakepkg": str(package)}
    advice = bytecode.bytecode_advice(found)
    assert advice.startswith("fakepkg has no bytecode") and advice.endswith(f"-m compileall -q {package}")


def test_bytecode_present_or_writable_is_not_named(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes it at the first import: nothing to say
    assert bytecode.recompiled_packages() == {}
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compileall.compile_dir(str(package / "fakepkg"), quiet=1)
    assert bytecode.recompiled_packages() == {}


def test_env_notes_name_the_packages(monkeypatch):
    monkeypatch.setattr(hardware, "recompiled_packages", lambda: {"torch": "/site"})
    notes = hardware.describe_environment().notes
    assert any(note.startswith("torch has no bytecode") and note.endswith("compileall -q /site") for note in notes)
