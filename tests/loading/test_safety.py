"""Checkpoints and configs from strangers: paths stay inside the model directory, absurd configs are refused
fast, and transformers' conventions (offload_folder, device and budget spellings, dtype="auto") carry over."""

import errno
import json
import shutil
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import devmap
from devmap import load, plan
from devmap.cli import main
from devmap.errors import CheckpointError, DevmapError, DoesNotFitError, SourceError, UsageError

from tiny_llama import copy_checkpoint, write_tiny_llama

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama"), "100KB", tie_word_embeddings=True,
                            num_hidden_layers=2, vocab_size=256)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir).eval()


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    return copy_checkpoint(llama_dir, tmp_path)


def logits(model):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def rewrite_index(path, change):
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    change(index["weight_map"])
    index_file.write_text(json.dumps(index))


# --- 1. a checkpoint's metadata must not reach outside its directory ---------------------------------------

@pytest.mark.parametrize("bad", ["../elsewhere.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                 "..\\x.safetensors", "./", "", "C:evil.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(llama_copy, tmp_path, bad):
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"x": torch.zeros(1)}, str(outside))
    first = sorted(llama_copy.glob("model-*.safetensors"))[0].name
    rewrite_index(llama_copy, lambda m: m.update({k: bad for k, v in m.items() if v == first}))
    with pytest.raises(CheckpointError, match="not a plain file name inside the model directory|not a file name"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_index_outside_the_directory_cli_is_one_line(llama_copy):
    first = sorted(llama_copy.glob("model-*.safetensors"))[0].name
    rewrite_index(llama_copy, lambda m: m.update({k: "../x.safetensors" for k, v in m.items() if v == first}))
    result = CliRunner().invoke(main, ["load", str(llama_copy), "--max-memory", "cpu=1GiB"])
    assert result.exit_code == 1
    assert "'../x.safetensors'" in result.output and "Traceback" not in result.output


def test_tokenizer_config_naming_a_file_outside_the_directory_is_refused(llama_copy):
    (llama_copy / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": "../../secret.json"}))
    with pytest.raises(CheckpointError, match="tokenizer_file"):
        plan(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_hf_cache_snapshot_with_symlinks_still_loads(llama_dir, reference, tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--someone--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(llama_dir.iterdir())):
        shutil.copy(file, blobs / f"blob{i:04d}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i:04d}")
    model = load(str(snapshot), max_memory={"cpu": "1GiB"})
    torch.testing.assert_close(logits(model), logits(reference))


# --- 2. absurd configs answer at once -----------------------------------------------------------------------

def write_config(path, **changes):
    path.mkdir(exist_ok=True)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256).to_dict()
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes, match", [
    (dict(num_hidden_layers=10**9), "layers is absurd"),
    (dict(vocab_size=10**12), "no machine holds"),
    (dict(hidden_size=2**20, intermediate_size=2**22, num_hidden_layers=500), "no machine holds"),
    (dict(num_hidden_layers="22"), "must be a whole number"),
    (dict(num_hidden_layers=-1), "must be a whole number"),
    (dict(hidden_size=True), "must be a whole number"),
    (dict(max_position_embeddings=10**15), "max_position_embeddings"),
    (dict(text_config=dict(num_hidden_layers=10**9)), "layers is absurd"),
])
def test_config_with_absurd_sizes_is_refused_before_building(tmp_path, changes, match):
    path = write_config(tmp_path / "m", **changes)
    start = time.perf_counter()
    with pytest.raises(SourceError, match=match):
        plan(str(path), gpus=2, gpu_memory="80GiB")
    assert time.perf_counter() - start < 10  # a hang guard, not a speed target: it used to run for minutes


def test_config_too_big_for_every_budget_is_refused_before_building(tmp_path):
    path = write_config(tmp_path / "m", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_key_value_heads=8, num_hidden_layers=500)
    with pytest.raises(DoesNotFitError, match=r"needs at least .* \(from its config.json\)"):
        plan(str(path), gpus=2, gpu_memory="80GiB", dtype="bf16")


def test_config_json_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(SourceError, match="not a JSON object"):
        plan(str(tmp_path))
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(SourceError):
        plan(str(tmp_path))


# --- 3. transformers' conventions ---------------------------------------------------------------------------

def test_offload_folder_alone_allows_disk(llama_dir, reference, tmp_path):
    folder = tmp_path / "off"
    placed = plan(str(llama_dir), max_memory={"cpu": "100KB"}, offload_folder=str(folder))
    assert "disk" in placed.device_map.values()
    free = shutil.disk_usage(tmp_path).free  # the folder does not exist yet: its nearest existing parent counts
    assert abs(placed.budget.limits["disk"] - free) <= 0.01 * free
    assert placed.devices["disk"].budget > 0
    model = load(str(llama_dir), max_memory={"cpu": "100KB"}, offload_folder=folder)
    torch.testing.assert_close(logits(model), logits(reference))


def test_offload_folder_alone_cli_shows_the_disk_budget(llama_dir, tmp_path):
    result = CliRunner().invoke(main, ["plan", str(llama_dir), "--max-memory", "cpu=100KB",
                                       "--offload-folder", str(tmp_path / "off")])
    assert result.exit_code == 0, result.output
    assert "disk" in result.output and "→ disk" in result.output


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu"), "CPU"])
def test_one_device_for_the_whole_model(llama_dir, reference, spec):
    model = load(str(llama_dir), spec, max_memory={"cpu": 10**9})
    assert model.hf_device_map == {"": "cpu"}
    torch.testing.assert_close(logits(model), logits(reference))


def test_device_map_spellings_transformers_users_write(llama_dir):
    by_int = plan(str(llama_dir), 0, max_memory={0: 10**9, "cpu": "1GiB"})
    by_name = plan(str(llama_dir), "cuda:0", max_memory={"cuda:0": "1GB", "cpu": 10**9})
    by_device = plan(str(llama_dir), torch.device("cuda", 0), max_memory={torch.device("cuda", 0): "1GB"})
    assert by_int.device_map == by_name.device_map == by_device.device_map == {"": 0}
    with pytest.raises(UsageError, match="unknown device map strategy or device 'mps'"):
        plan(str(llama_dir), "mps")
    with pytest.raises(UsageError, match="whole model on disk"):
        plan(str(llama_dir), "disk")


def test_dtype_auto_keeps_the_checkpoints_dtype(llama_dir):
    assert plan(str(llama_dir), dtype="auto", max_memory={"cpu": "1GiB"}).dtype == torch.float32
    assert load(str(llama_dir), dtype="auto", max_memory={"cpu": "1GiB"}).model.embed_tokens.weight.dtype == \
        torch.float32


def test_load_takes_no_split_module_classes(llama_dir):
    model = load(str(llama_dir), "balanced", max_memory={"cpu": "1GiB"}, no_split_module_classes=["LlamaMLP"])
    assert model.devmap_plan.no_split_module_classes == ["LlamaMLP"]


def test_device_map_json_file(llama_dir, tmp_path):
    out = CliRunner().invoke(main, ["plan", str(llama_dir), "--max-memory", "cpu=1GiB", "--json"]).output
    map_file = tmp_path / "map.json"
    map_file.write_text(out)  # the whole `plan --json` output is accepted, as is its device_map alone
    result = CliRunner().invoke(main, ["plan", str(llama_dir), "--device-map", str(map_file), "--max-memory",
                                       "cpu=1GiB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device_map"] == json.loads(out)["device_map"]
    bad_files = [("[1]", "non-empty JSON object"), ('{"model": [0]}', "puts 'model' on"), ("{", "not valid JSON")]
    for bad, match in bad_files:
        map_file.write_text(bad)
        result = CliRunner().invoke(main, ["plan", str(llama_dir), "--device-map", str(map_file)])
        assert result.exit_code == 2 and match in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["plan", str(llama_dir), "--device-map", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "does not exist" in result.output


# --- nothing half-done after a failure ----------------------------------------------------------------------

def test_disk_full_while_saving_leaves_nothing(tmp_path, monkeypatch):
    from devmap.loading import saver

    calls = []

    def full_disk(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        saver.__dict__["_real_write_shard"](tensors, path)

    monkeypatch.setitem(saver.__dict__, "_real_write_shard", saver._write_shard)
    monkeypatch.setattr(saver, "_write_shard", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        devmap.save("llama-tiny", tmp_path / "out", max_shard_size="200KB")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []  # no output directory and no temporary one


def test_disk_full_while_offloading_leaves_no_half_written_files(llama_dir, tmp_path, monkeypatch):
    import accelerate.utils

    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "mine.txt").write_text("kept")
    real = accelerate.utils.offload_weight
    calls = []

    def full_disk(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(accelerate.utils, "offload_weight", full_disk)
    with pytest.raises(CheckpointError, match="offload folder .* No space left on device"):
        load(str(llama_dir), max_memory={"cpu": "100KB"}, offload_folder=folder)
    assert len(calls) == 3
    assert sorted(p.name for p in folder.iterdir()) == ["mine.txt"]
    calls.clear()
    with pytest.raises(DevmapError):
        load(str(llama_dir), max_memory={"cpu": "100KB"}, offload_folder=tmp_path / "new")
    assert not (tmp_path / "new").exists()


# --- CLI numbers a stranger controls ------------------------------------------------------------------------

def test_a_huge_simulated_gpu_count_is_refused_instead_of_looping():
    result = CliRunner().invoke(main, ["plan", "resnet50", "--gpus", "99999999", "--gpu-memory", "1GB"])
    assert result.exit_code == 2 and "at most 4096" in result.output


def test_many_equal_budgets_print_as_one_run():
    from devmap.planning.budget import resolve_budget

    label = resolve_budget(gpus=64, gpu_memory="1GiB").label()
    assert label == "cuda:0-63 1.00 GiB each"


def test_a_prompt_longer_than_the_context_is_refused_before_loading():
    result = CliRunner().invoke(main, ["generate", "llama-tiny", "--max-memory", "cpu=1GB", "--prompt-len", "100000"])
    assert result.exit_code == 2 and "more than the model's context of 256 tokens" in result.output
