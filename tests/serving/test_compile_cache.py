"""The compile cache: an entry torch cannot read is removed and made anew with one warning, other failures pass
through as they came, and a restart finds its graphs in the cache (inductor on this CPU, in fresh processes)."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from devmap.serving.compile_cache import RETRIES, compiled_anew, named_entries


def test_the_cache_files_an_error_names_are_found_through_the_errors_it_came_from(tmp_path):
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (cache / "5n").mkdir(parents=True)
    elsewhere.mkdir()
    entry, other = cache / "5n" / "kernel.main.so", elsewhere / "kernel.so"
    entry.write_bytes(b"cut")
    other.write_bytes(b"ok")
    try:
        try:
            raise ImportError(f"{entry}: file too short")
        except ImportError as inner:
            raise RuntimeError(f"backend='inductor' raised: {inner}; also read {other}") from inner
    except RuntimeError as exc:
        error = exc
    assert named_entries(error, (cache,)) == [entry]  # only inside the cache, each file once
    assert named_entries(RuntimeError(f"{cache / 'gone.so'}: missing"), (cache,)) == []  # existing files only


def test_a_compile_that_fails_on_a_cache_entry_is_made_anew_once_it_is_removed(tmp_path, caplog):
    entry = tmp_path / "kernel.so"
    entry.write_bytes(b"cut")
    attempts, undone = [], []

    def compile():
        attempts.append(entry.exists())
        if entry.exists():
            raise ImportError(f"{entry}: file too short")
        return "compiled"

    with caplog.at_level(logging.WARNING, logger="devmap.serving"):
        assert compiled_anew(compile, lambda: undone.append(True), lambda: (tmp_path,)) == "compiled"
    assert attempts == [True, False] and undone == [True] and not entry.exists()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0].getMessage()


def test_other_failures_pass_through_and_the_retries_are_bounded(tmp_path):
    def unrelated():
        raise RuntimeError("no C++ compiler")

    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        compiled_anew(unrelated, folders=lambda: (tmp_path,))
    calls = []

    def always_a_new_bad_entry():  # each attempt names another file in the cache
        entry = tmp_path / f"kernel{len(calls)}.so"
        entry.write_bytes(b"cut")
        calls.append(entry)
        raise ImportError(f"{entry}: file too short")

    with pytest.raises(ImportError):
        compiled_anew(always_a_new_bad_entry, folders=lambda: (tmp_path,))
    assert len(calls) == RETRIES + 1


CHILD = textwrap.dedent("""
    import json, logging, torch
    from devmap.compat import compile_totals
    from devmap.serving.compile_cache import compiled_anew

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    def run():
        @torch.compile(backend="inductor")
        def f(x):
            return (x.sin() * 2 + x.cos()).sum(-1)
        return f(torch.ones(4, 8))
    before = compile_totals()
    out = compiled_anew(run)
    after = compile_totals()
    print(json.dumps({"sum": float(out.sum()), "graphs": after.graphs - before.graphs,
                      "from_cache": after.from_cache - before.from_cache}))
""")


def test_a_restart_reads_its_graphs_from_the_cache_and_a_cut_entry_is_made_anew(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}

    def start() -> tuple[dict, str]:
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    first, _ = start()
    assert first["graphs"] == 1 and first["from_cache"] == 0
    again, log = start()
    assert again == {**first, "from_cache": 1} and "compile cache held" not in log
    # the graph's kernel library (inductor names it *.main.so; its vector-instruction probe's library is another .so)
    libraries = list((tmp_path / "inductor").rglob("*.main.so"))
    assert libraries
    for library in libraries:  # cut short, as a full disk leaves a file
        library.write_bytes(library.read_bytes()[:16])
    healed, log = start()
    assert healed["sum"] == first["sum"] and log.count("compile cache held entries torch could not read") == 1
    last, log = start()
    assert last == again and "compile cache held" not in log  # made anew: read from the cache again


@pytest.mark.parametrize("split", [False, True], ids=["whole model", "split over processes"])
def test_a_load_compiles_anew_past_a_cut_entry_unless_its_processes_warm_up_in_step(tmp_path, monkeypatch, split):
    # a split's processes meet in collectives in order during their warm-up: one of them starting it again alone
    # would pair its collectives with the others' later ones
    import types

    import devmap.generation.step_cache as step_cache
    import devmap.serving.warm_up as warm_up
    from devmap.serving import prepare
    from devmap.serving.limits import EngineLimits
    from devmap.serving.load_phases import CompiledGraphs, LoadPhases

    entry = tmp_path / "kernel.so"
    entry.write_bytes(b"cut")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls = []

    def warming(*args, **kwargs):
        calls.append(entry.exists())
        if entry.exists():
            raise ImportError(f"{entry}: file too short")
        return warm_up.WarmUpTimes(1.0, 0.5, 0.25, CompiledGraphs(total=3, from_cache=0))

    monkeypatch.setattr(warm_up, "compiles", lambda model, wanted, quantization: True)
    monkeypatch.setattr(warm_up, "warm_up", warming)
    monkeypatch.setattr(step_cache, "release_graphs", lambda model: None)
    model = types.SimpleNamespace(devmap_plan=types.SimpleNamespace(tensor_parallel=object() if split else None))
    phases = LoadPhases()
    compiled = prepare._compiled(model, EngineLimits(), None, rows=8, context=256, lanes=1, phases=phases)
    if split:  # eager steps, with the reason, as any failed compile; the entry left for the next start's compile
        assert not compiled and calls == [True] and entry.exists()
    else:
        assert compiled and calls == [True, False] and not entry.exists()
        assert phases.seconds == {"compile": 1.0, "capture": 0.5, "warm_up": 0.25} and phases.graphs.total == 3
