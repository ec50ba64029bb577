"""`devmap save`: checkpoints transformers and torchvision read back, sharding, seeds, dtypes and safe failure."""

import json

import pytest
import torch
import torchvision
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from devmap.loading import saver
from devmap.cli import main
from devmap.errors import CheckpointError, UsageError


def read_dir(path):
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        tensors.update(load_file(str(file)))
    return tensors


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize("shard_size, files", [("5GB", 1), ("100KB", 9)])
def test_llama_tiny_loads_in_transformers(tmp_path, shard_size, files):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tiny"
    result = saver.save("llama-tiny", out, max_shard_size=shard_size)
    assert result.sharded == (files > 1) and result.dtype == "float32" and result.num_tensors == 38
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == files
    if files > 1:
        assert shards[0].name == f"model-00001-of-{files:05d}.safetensors"
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {s.name for s in shards}
        assert index["metadata"]["total_size"] == result.total_bytes
    else:
        assert shards[0].name == "model.safetensors" and not (out / "model.safetensors.index.json").exists()
    tensors = read_dir(out)
    assert "lm_head.weight" not in tensors and not any("inv_freq" in k for k in tensors)
    assert sum(t.nbytes for t in tensors.values()) == result.total_bytes

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert set(state) == set(tensors) | {"lm_head.weight"}
    assert all(torch.equal(state[k], t) for k, t in tensors.items())
    assert torch.equal(state["lm_head.weight"], tensors["model.embed_tokens.weight"])
    # The init rules: norms 1, Linear/Embedding N(0, initializer_range).
    assert torch.all(tensors["model.norm.weight"] == 1)
    assert abs(tensors["model.embed_tokens.weight"].std().item() - 0.02) < 0.002


def test_seed_gives_identical_bytes(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        saver.save("llama-tiny", tmp_path / name, seed=seed, max_shard_size="300KB")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "c").iterdir())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    first = next(f for f in files if f.startswith("model-00001-of-"))
    assert (tmp_path / "a" / first).read_bytes() != (tmp_path / "c" / first).read_bytes()


def test_bf16_is_written_as_bf16(tmp_path):
    saver.save("llama-tiny", tmp_path / "f32")
    result = saver.save("llama-tiny", tmp_path / "bf16", dtype="bf16")
    assert result.dtype == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    f32, bf16 = read_dir(tmp_path / "f32"), read_dir(tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(f32[k].to(torch.bfloat16), t) for k, t in bf16.items())  # same draws, rounded


def test_resnet18_keys_and_config(tmp_path):
    result = saver.save("resnet18", tmp_path / "r18")
    tensors = read_dir(tmp_path / "r18")
    expected = torchvision.models.resnet18().state_dict()
    assert list(tensors) and set(tensors) == set(expected) and result.num_tensors == len(expected)
    assert all(tensors[k].shape == v.shape and tensors[k].dtype == v.dtype for k, v in expected.items())
    assert torch.all(tensors["bn1.running_var"] == 1) and torch.all(tensors["bn1.running_mean"] == 0)
    assert tensors["bn1.num_batches_tracked"].item() == 0 and tensors["bn1.num_batches_tracked"].dtype == torch.long
    config = json.loads((tmp_path / "r18" / "config.json").read_text())
    assert config["torchvision_model"] == "resnet18" and config["num_classes"] == 1000

    from devmap.planning.models import resolve_source

    assert resolve_source(str(tmp_path / "r18")).name == "resnet18"


def test_resnet18_weights_round_trip(tmp_path):
    reference = torchvision.models.resnet18().state_dict()
    save_file(reference, str(tmp_path / "r18.safetensors"))
    saver.save("resnet18", tmp_path / "out", weights=tmp_path / "r18.safetensors", max_shard_size="10MB")
    tensors = read_dir(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert set(tensors) == set(reference) and all(torch.equal(tensors[k], v) for k, v in reference.items())


def test_weights_that_do_not_match(tmp_path):
    reference = torchvision.models.resnet18().state_dict()
    reference.pop("fc.bias")
    reference["conv1.weight"] = torch.zeros(1, 1)
    reference["extra.weight"] = torch.zeros(1)
    save_file(reference, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1: fc\.bias.*unexpected 1: extra\.weight.*conv1\.weight"):
        saver.save("resnet18", tmp_path / "out", weights=tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        saver.save("resnet18", tmp_path / "out", weights=tmp_path / "nope.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


def test_cli_summary_and_json(tmp_path):
    code, out = run("save", "llama-tiny", tmp_path / "t", "--dtype", "bf16")
    assert code == 0, out
    assert "Saved llama-tiny" in out and "bfloat16" in out and "model.safetensors" in out
    code, out = run("save", "resnet18", tmp_path / "r", "--max-shard-size", "20MB", "--seed", "3", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["sharded"] is True and data["dtype"] == "float32" and "model.safetensors.index.json" in data["files"]
    assert sorted(data["files"]) == sorted(p.name for p in (tmp_path / "r").iterdir())


def test_overwrite_replaces_the_directory(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "stale.txt").write_text("old")
    code, out = run("save", "llama-tiny", tmp_path / "t", "--overwrite", "--json")
    assert code == 0, out
    assert not (tmp_path / "t" / "stale.txt").exists() and (tmp_path / "t" / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


@pytest.mark.parametrize("args, words", [
    (["save", "llama-tiny", "{tmp}/full"], "exists and is not empty; pass --overwrite"),
    (["save", "llama-tiny", "{tmp}/new", "--max-shard-size", "12XB"], "unknown unit 'XB'"),
    (["save", "llama-tiny", "{tmp}/new", "--max-shard-size", "0"], "must be above 0"),
    (["save", "llama-99b", "{tmp}/new"], "unknown model source 'llama-99b'"),
    (["save", "{tmp}/full", "{tmp}/new"], "save makes new checkpoints from presets"),
    (["save", "llama-tiny", "{tmp}/new", "--dtype", "int8"], "unsupported dtype"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, words):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text('{"torchvision_model": "resnet18"}')
    code, out = run(*[a.format(tmp=tmp_path) for a in args])
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch, error):
    calls = []

    def failing_writer(tensors, path):
        calls.append(path.name)
        if len(calls) == 2:
            raise error
        real_writer(tensors, path)

    real_writer = saver._write_shard
    monkeypatch.setattr(saver, "_write_shard", failing_writer)
    expected = CheckpointError if isinstance(error, OSError) else KeyboardInterrupt
    with pytest.raises(expected):
        saver.save("llama-tiny", tmp_path / "out", max_shard_size="100KB")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_failure_keeps_the_old_directory_on_overwrite(tmp_path, monkeypatch):
    saver.save("llama-tiny", tmp_path / "out", seed=1)
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    monkeypatch.setattr(saver, "_write_shard", lambda tensors, path: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        saver.save("llama-tiny", tmp_path / "out", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before


def test_cli_failure_mid_write_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(saver, "_write_shard", lambda tensors, path: (_ for _ in ()).throw(OSError(28, "No space")))
    code, out = run("save", "llama-tiny", tmp_path / "out", "--json")
    assert code == 1 and out.strip().startswith("Error: could not write") and "No space" in out, out
    assert list(tmp_path.iterdir()) == []


def test_progress_reaches_total(tmp_path):
    seen = []
    result = saver.save("llama-tiny", tmp_path / "t", progress=lambda done, total: seen.append((done, total)))
    assert seen[0] == (0, result.total_bytes) and seen[-1] == (result.total_bytes, result.total_bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert result.to_dict()["out_dir"] == str(tmp_path / "t") and json.dumps(result.to_dict())


def test_library_usage_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        saver.save("llama-tiny", tmp_path / "file")
    with pytest.raises(UsageError, match="is not a writable directory"):
        saver.save("llama-tiny", tmp_path / "file" / "sub")


def test_a_config_only_directory_loads_the_presets_random_weights(tmp_path):
    """`--config-only` writes the configs and tokenizer, no tensors; loading it with random weights gives what
    loading the preset gives (same seed, same devices), and loading it for its weights says how to get random ones."""
    import devmap

    code, out = run("save", "llama-tiny", tmp_path / "m", "--config-only")
    assert code == 0 and "0 tensors" in out
    assert not list((tmp_path / "m").glob("*.safetensors")) and (tmp_path / "m" / "tokenizer.json").exists()
    made = devmap.load(tmp_path / "m", "cpu", random_weights=True, seed=3)
    preset = devmap.load("llama-tiny", "cpu", seed=3)
    assert made.devmap_load_report.random_init
    assert {n: p for n, p in made.state_dict().items()}.keys() == preset.state_dict().keys()
    for name, tensor in made.state_dict().items():
        assert torch.equal(tensor, preset.state_dict()[name]), name
    with pytest.raises(CheckpointError, match="random_weights=True"):
        devmap.load(tmp_path / "m", "cpu")
    with pytest.raises(UsageError, match="random_weights reads no weights"):
        devmap.load(tmp_path / "m", "cpu", weights=tmp_path / "w.safetensors", random_weights=True)
    code, out = run("save", "llama-tiny", tmp_path / "q", "--config-only", "--weights", tmp_path / "w.safetensors")
    assert code == 2 and "config-only directory holds no weights" in out
