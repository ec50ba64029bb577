"""The CLI through click's CliRunner: plan, env, --json, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from devmap.cli import main


def run(*args):
    """Exit code and output; with --json only stdout (libraries may log to stderr: torchao's import does)."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout if "--json" in args and result.exit_code == 0 else result.output


def test_help_does_not_import_torch():
    code = "import sys, devmap.cli; devmap.cli.main.name; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_program_ends_with_its_exit_code_after_the_exit_handlers_and_its_output():
    """`devmap` ends without the interpreter's teardown: the exit code, everything printed and what atexit
    handlers do are kept; a command that leaves a thread running ends as usual (after the thread)."""
    template = ("import atexit, sys, threading, time\n"
                "atexit.register(lambda: print('handler ran', flush=True))\n{extra}"
                "sys.argv = ['devmap', *{args!r}]\nfrom devmap.cli import run\nrun()\n")
    cases = [((["plan", "llama-tiny", "--json"]), "", 0), ((["plan", "nope"]), "", 2),
             ((["plan", "llama-tiny", "--gpus", "x"]), "", 2),
             ((["env", "--json"]), "threading.Thread(target=lambda: (time.sleep(0.5), print('thread ended')))"
                                   ".start()\n", 0)]
    for args, extra, code in cases:
        done = subprocess.run([sys.executable, "-c", template.format(extra=extra, args=args)], capture_output=True,
                              text=True)
        assert done.returncode == code, (args, done.stderr)
        assert done.stdout.rstrip().endswith("handler ran"), (args, done.stdout)
        printed = [line for line in done.stdout.splitlines() if line not in ("handler ran", "thread ended")]
        if code == 0:
            assert json.loads("\n".join(printed))
        else:
            assert done.stderr.startswith("Error: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert ("thread ended" in done.stdout) == bool(extra)


def test_plan_table():
    code, out = run("plan", "resnet50", "--gpus", "2", "--gpu-memory", "80GiB")
    assert code == 0, out
    assert "cuda:0" in out and "cuda:1" in out and "Map:" in out
    assert "conv1 … " in out and "→ cuda:1" in out


def test_plan_json_70b():
    code, out = run("plan", "llama-2-70b", "--gpus", "2", "--gpu-memory", "80GiB", "--dtype", "bf16", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert set(data["device_map"].values()) == {0, 1}
    assert set(data["devices"]) == {"cuda:0", "cuda:1"}
    for usage in data["devices"].values():
        assert {"modules", "params", "bytes", "budget"} <= set(usage)
        assert usage["bytes"] <= usage["budget"]


def test_plan_max_memory_with_cpu_offload():
    code, out = run("plan", "tinyllama-1.1b", "--max-memory", "0=600MiB,1=600MiB,cpu=8GiB", "--dtype", "bf16", "--json")
    assert code == 0, out
    assert "cpu" in set(json.loads(out)["device_map"].values())


def test_plan_layers_resnet():
    code, out = run("plan", "resnet50", "--gpus", "2", "--gpu-memory", "1GiB", "--layers", "--input-shape", "2,3,64,64")
    assert code == 0, out
    assert "Layers:" in out
    fc_line = next(line for line in out.splitlines() if line.startswith("fc "))
    assert "2x1000" in fc_line and "2,049,000" in fc_line and "cuda:1" in fc_line


def test_plan_layers_json_llama():
    code, out = run("plan", "llama-tiny", "--gpus", "2", "--gpu-memory", "1MB", "--layers", "--json")
    assert code == 0, out
    layers = {row["name"]: row for row in json.loads(out)["layers"]}
    assert layers["lm_head"]["output_shape"] == [1, 128, 512]
    assert layers["model.layers.0.mlp.down_proj"]["type"] == "Linear"


def test_env_without_gpus():
    code, out = run("env")
    assert code == 0, out
    assert "torch" in out and "CPU:" in out
    code, out = run("env", "--json")
    data = json.loads(out)
    assert {"gpus", "peer_access", "cpu_total_bytes", "versions"} <= set(data)
    assert "transformers" in data["versions"]


@pytest.mark.parametrize("args, words", [
    (["plan", "resnet50", "--device-map", "fastest", "--gpus", "1", "--gpu-memory", "1GiB"],
     "auto, balanced, balanced_low_0, sequential"),
    (["plan", "resnet50", "--gpus", "2", "--gpu-memory", "12XB"], "unknown unit 'XB'"),
    (["plan", "resnet50", "--gpus", "2", "--gpu-memory", "-1GiB"], "cannot be negative"),
    (["plan", "resnet50", "--max-memory", "0=abc"], "expected a number with a unit"),
    (["plan", "resnet50", "--max-memory", "0=1GiB,cpu=120%"], "at most 100%"),
    (["plan", "resnet99"], "use a preset (resnet18"),
    (["plan", "meta-llama/Llama-2-7b-hf"], "never contacts a model hub"),
    (["plan", "llama-2-70b", "--gpus", "2", "--gpu-memory", "20GiB", "--dtype", "bf16"], "fits nowhere"),
    (["plan", "resnet50", "--gpus", "1", "--gpu-memory", "1GiB", "--dtype", "int8"], "unsupported dtype"),
    (["plan", "resnet50", "--gpus", "1", "--gpu-memory", "1GiB", "--input-shape", "1,3"],
     "applies with --layers or --for"),
    (["plan", "resnet50", "--bogus"], "No such option"),
])
def test_bad_input_is_one_line_exit_2(args, words):
    code, out = run(*args)
    assert code == 2, out
    assert words in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    assert "Traceback" not in out


def test_bad_config_json_from_cli(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    code, out = run("plan", str(tmp_path), "--gpus", "1", "--gpu-memory", "1GiB")
    assert code == 2 and "not valid JSON" in out


def test_generated_text_shows_control_characters_as_escapes():
    from devmap.cli.generate_cmd import shown

    assert shown("Hello\r\x00 wörld\n\tok\x1b[31m") == "Hello\\r\\x00 wörld\n\tok\\x1b[31m"


def test_serve_keeps_compiled_steps_where_it_is_told_else_in_the_users_cache(tmp_path, monkeypatch):
    from importlib import metadata

    from devmap.serving.compile_cache import release_key, use_compile_cache

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "DEVMAP_REGION_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    key = release_key()  # a folder per release: another torch or transformers never reads these entries
    assert f"torch-{metadata.version('torch')}" in key and f"transformers-{metadata.version('transformers')}" in key
    assert use_compile_cache(None) == (tmp_path / "home" / ".cache" / "devmap" / "compile" / key).resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(
        (tmp_path / "home" / ".cache" / "devmap" / "compile" / key / "inductor").resolve())
    assert os.environ["DEVMAP_REGION_STORE"] == str(
        (tmp_path / "home" / ".cache" / "devmap" / "compile" / key / "regions").resolve())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert use_compile_cache(None) is None  # inductor's own variable, set: left as it is, devmap's regions inside
    assert os.environ["DEVMAP_REGION_STORE"] == str((tmp_path / "theirs" / "devmap-regions").resolve())
    use_compile_cache(str(tmp_path / "mine"))  # named: always
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "mine" / key / "triton").resolve())
    assert os.environ["DEVMAP_REGION_STORE"] == str((tmp_path / "mine" / key / "regions").resolve())


def test_serve_on_an_address_in_use_fails_at_once_in_one_line(tmp_path):
    """The address is bound before the engine core starts or any model loads: a port in use is one line, exit 1."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "devmap", "serve", str(tmp_path), "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): stop "
                                          "what listens there or pick another --port"], result.stderr


def test_serve_of_a_model_without_a_tokenizer_ends_in_one_line_while_its_early_load_runs(tmp_path):
    """The engine core loads the command line's models from its start (`EngineCore.load_early`) while the API's
    process reads their tokenizers: a directory without tokenizer files ends the service with one line, exit 1, and
    the core's process ends after the load in flight, not under it (no teardown errors on the terminal)."""
    import devmap

    devmap.save("llama-tiny", tmp_path / "tiny")
    for tokenizer_file in (tmp_path / "tiny").glob("tokenizer*"):
        tokenizer_file.unlink()
    result = subprocess.run([sys.executable, "-m", "devmap", "serve", str(tmp_path / "tiny"), "--port", "0",
                             "--log-level", "warning"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: tiny has no usable tokenizer (") and line.endswith(
        "a server answers text, so the directory needs tokenizer files (devmap save writes them)"), line
