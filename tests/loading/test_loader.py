"""Loading and dispatch on CPU and disk: same logits as transformers / torchvision, offload, training, bad input."""

import json
import re
import os
import struct

import pytest
import torch
import torchvision
from click.testing import CliRunner
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from devmap import dispatch, load
from devmap.cli import main
from devmap.errors import CheckpointError, DoesNotFitError, SourceError, UsageError
from devmap.testing import ToyModel

from tiny_llama import copy_checkpoint, write_tiny_llama

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny LLaMA written by transformers' own save_pretrained, sharded."""
    return write_tiny_llama(tmp_path_factory.mktemp("llama"), "200KB", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def tokens():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


def test_sharded_transformers_checkpoint_same_logits(llama_dir, reference):
    assert (llama_dir / "model.safetensors.index.json").exists()
    model = load(str(llama_dir), max_memory={"cpu": "1GiB"})
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, reference(tokens()).logits, rtol=0, atol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    report = model.devmap_load_report
    assert not report.random_init and report.bytes_read == 0  # host memory in the stored dtype: mapped, not read
    assert report.mapped_bytes > 0
    assert model.hf_device_map == model.devmap_plan.device_map


def test_disk_offload_same_logits(llama_dir, reference, tmp_path):
    folder = tmp_path / "offload"
    model = load(str(llama_dir), "sequential", max_memory={"cpu": "400KB", "disk": "1GiB"}, offload_folder=folder)
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, reference(tokens()).logits)
    files = os.listdir(folder)
    assert "index.json" in files and any(f.endswith(".dat") for f in files)
    disk_modules = [n for n, d in model.hf_device_map.items() if d == "disk"]
    assert any(f.startswith(disk_modules[0]) for f in files)


def test_a_finished_plan_loads_as_planned_without_planning_again(llama_dir, reference, tmp_path, monkeypatch):
    """`load(source, plan=devmap.plan(...))` places, casts and offloads as the plan says and never plans again; a plan
    of another model, or options the plan already settled, are refused with one line."""
    import devmap
    from devmap.loading import loader

    folder = tmp_path / "offload"
    plan = devmap.plan(str(llama_dir), "sequential", {"cpu": "400KB", "disk": "1GiB"}, "bf16", offload_folder=folder)
    monkeypatch.setattr(loader, "plan_model", lambda *args, **kwargs: pytest.fail("planned again"))
    model = load(str(llama_dir), plan=plan, offload_folder=folder)
    assert model.devmap_plan is plan and model.hf_device_map == plan.device_map
    assert set(model.hf_device_map.values()) == {"cpu", "disk"} and model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits.float(), reference(tokens()).logits, atol=0.1, rtol=0.1)
    with pytest.raises(UsageError, match="settles device_map, dtype"):
        load(str(llama_dir), "balanced", dtype="fp16", plan=plan)
    with pytest.raises(UsageError, match="made for"):
        load("llama-tiny", plan=plan)


def test_dtype_casts_on_load(llama_dir, reference):
    model = load(str(llama_dir), max_memory={"cpu": "1GiB"}, dtype="bf16")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # non-persistent buffers keep their precision
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits.float(), reference(tokens()).logits, atol=0.1, rtol=0.1)


def test_resnet_from_safetensors_matches_torchvision(tmp_path):
    ref = torchvision.models.resnet18(num_classes=10).eval()
    for m in ref.modules():  # non-trivial BN statistics
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "r18.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    # torchvision's default head has 1000 classes: the shape check names the mismatch
    with pytest.raises(CheckpointError, match=r"fc.weight \[10, 512\] vs model \[1000, 512\]"):
        load("resnet18", max_memory={"cpu": "1GiB"}, weights=path)
    config = tmp_path / "dir"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"torchvision_model": "resnet18", "num_classes": 10}))
    os.replace(path, config / "model.safetensors")
    model = load(str(config), max_memory={"cpu": "1GiB"})
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def test_random_init_preset_reports_it():
    model = load("llama-tiny", max_memory={"cpu": "1GiB"})
    assert model.devmap_load_report.random_init
    w = model.model.layers[0].mlp.up_proj.weight
    assert 0.015 < w.std().item() < 0.025 and torch.all(model.model.norm.weight == 1)


def test_dispatch_toy_model_trains_like_the_plain_model():
    plain = ToyModel()
    placed = ToyModel()
    placed.load_state_dict(plain.state_dict())
    dispatch(placed, {"net1": "cpu", "relu": "cpu", "net2": "cpu"}, max_memory={"cpu": "1GiB"})
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    for model in (plain, placed):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.testing.assert_close(placed.net2.weight, plain.net2.weight)
    torch.testing.assert_close(placed(x), plain(x))


def test_dispatch_with_disk_offload(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).eval()
    x = torch.randn(3, 256)
    expected = model(x)
    dispatch(model, {"0": "cpu", "1": "cpu", "2": "disk"}, max_memory={"cpu": "1GiB"}, offload_folder=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    assert (tmp_path / "index.json").exists()


def corrupt(path, mode):
    data = bytearray(path.read_bytes())
    if mode == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif mode == "header":
        (n,) = struct.unpack("<Q", data[:8])
        data[8:8 + n] = b"{" * n
        path.write_bytes(bytes(data))


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    return copy_checkpoint(llama_dir, tmp_path)


def first_shard(path):
    return sorted(path.glob("model-*.safetensors"))[0]


def test_truncated_shard(llama_copy):
    corrupt(first_shard(llama_copy), "truncate")
    with pytest.raises(CheckpointError, match="truncated"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_corrupted_header(llama_copy):
    corrupt(first_shard(llama_copy), "header")
    with pytest.raises(CheckpointError, match="corrupted"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_missing_shard(llama_copy):
    first_shard(llama_copy).unlink()
    with pytest.raises(CheckpointError, match="names 1 missing file"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_shape_mismatch(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["intermediate_size"] = 128
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="don't match the config"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})


def test_missing_and_unexpected_keys(llama_copy):
    index = json.loads((llama_copy / "model.safetensors.index.json").read_text())
    config = json.loads((llama_copy / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensor\(s\) of the model: model.layers.4"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})
    model = load(str(llama_copy), max_memory={"cpu": "1GiB"}, allow_missing=True)
    assert "model.layers.4.mlp.up_proj.weight" in model.devmap_load_report.initialized
    config["num_hidden_layers"] = 3
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unexpected tensor.*model.layers.3"):
        load(str(llama_copy), max_memory={"cpu": "1GiB"})
    assert index["weight_map"]


def test_bad_arguments_before_any_read(llama_dir, tmp_path):
    with pytest.raises(UsageError, match="unsupported dtype"):
        load(str(llama_dir), dtype="int4")
    with pytest.raises(SourceError, match="never contacts a model hub"):
        load("someone/some-model")
    with pytest.raises(UsageError, match="does not exist"):
        load("resnet18", weights=tmp_path / "nope.safetensors")
    with pytest.raises(DoesNotFitError, match="fits nowhere"):
        load(str(llama_dir), max_memory={"cpu": "10KB"})
    with pytest.raises(UsageError, match="pass --offload-folder"):
        load(str(llama_dir), max_memory={"cpu": "100KB", "disk": "1GiB"})
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="can't be written"):
        load(str(llama_dir), max_memory={"cpu": "100KB", "disk": "1GiB"}, offload_folder=blocker / "sub")
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0  # the first GPU index not visible
    with pytest.raises(UsageError, match=f"puts blocks on cuda:{missing}, but {missing} GPU"):
        load(str(llama_dir), max_memory={missing: "1GiB"})


def test_pickle_refused_unless_allowed(tmp_path):
    ref = torchvision.models.resnet18().eval()
    path = tmp_path / "r18.pt"
    torch.save(ref.state_dict(), path)
    with pytest.raises(UsageError, match="--allow-pickle"):
        load("resnet18", weights=path)
    model = load("resnet18", weights=path, allow_pickle=True, max_memory={"cpu": "1GiB"})
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_cli_load_json_and_errors(llama_dir, llama_copy):
    runner = CliRunner()
    result = runner.invoke(main, ["load", str(llama_dir), "--max-memory", "cpu=1GiB", "--run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["run"]["output_shape"] == [1, 128, 512]
    assert data["load"]["devices"]["cpu"]["planned_bytes"] > 0
    corrupt(first_shard(llama_copy), "truncate")
    result = runner.invoke(main, ["load", str(llama_copy), "--max-memory", "cpu=1GiB"])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "truncated" in result.output
    result = runner.invoke(main, ["load", "a/b"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_random_init_straight_to_disk_keeps_ties(tmp_path):
    # disk-bound weights are made one module at a time; a tied alias gets its own index entry
    model = load("llama-tiny", "sequential", max_memory={"cpu": "100KB", "disk": "1GiB"}, offload_folder=tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(index)
    with torch.no_grad():
        logits = model(tokens()).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_load_on_the_cpu_shows_the_bytes_it_allocated(llama_dir):
    """`devmap load` on a CPU printed `allocated -`: it shows the bytes now, equal to the plan's."""
    result = CliRunner().invoke(main, ["load", str(llama_dir), "--max-memory", "cpu=1GiB", "--json"])
    assert result.exit_code == 0, result.output
    cpu = json.loads(result.stdout)["load"]["devices"]["cpu"]
    assert cpu["allocated_bytes"] == cpu["planned_bytes"] > 0
    table = CliRunner().invoke(main, ["load", str(llama_dir), "--max-memory", "cpu=1GiB"])
    lines = table.output.splitlines()
    at = next(k for k, line in enumerate(lines) if line.split()[:1] == ["device"] and "allocated" in line)
    header, row = lines[at].split(), re.split(r"\s{2,}", lines[at + 2].strip())
    assert row[header.index("allocated")] == row[header.index("planned")] != "-"
