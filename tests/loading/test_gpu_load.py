"""GPU-only: every strategy places blocks where the plan says, outputs equal one device, memory matches the plan."""

import gc
import json

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from devmap import dispatch, load
from devmap.planning.placement import STRATEGIES
from devmap.testing import ToyModel, require_gpus

pytestmark = require_gpus(2)


def allocated():
    gc.collect()  # models of earlier tests must not be freed in the middle of a measurement
    return {g: torch.cuda.memory_allocated(g) for g in range(torch.cuda.device_count())}


def check_memory(model, before):
    """Each GPU's allocated bytes are within 10% of the plan's bytes for it."""
    after = allocated()
    for label, usage in model.devmap_plan.devices.items():
        if label.startswith("cuda:") and usage.bytes > 2**20:
            g = int(label.split(":")[1])
            assert abs((after[g] - before[g]) - usage.bytes) <= 0.1 * usage.bytes, (label, after[g] - before[g], usage)


def check_placement(model):
    for name, device in model.hf_device_map.items():
        tensors = list(model.get_submodule(name).parameters()) if name else list(model.parameters())
        for t in tensors:
            assert t.device == torch.device("cuda", device), (name, t.device, device)


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("resnet50")
    ref = torchvision.models.resnet50().eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"torchvision_model": "resnet50", "num_classes": 1000}))
    return path, ref


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resnet50_strategies(resnet_dir, strategy):
    path, ref = resnet_dir
    before = allocated()
    model = load(str(path), strategy, max_memory={0: "60MiB", 1: "60MiB"})
    check_placement(model)
    check_memory(model, before)
    devices = set(model.hf_device_map.values())
    assert devices == {0, 1}  # 98 MiB of weights cannot fit one 60 MiB budget
    x = torch.randn(4, 3, 224, 224)
    with torch.no_grad():
        expected = ref.to("cuda:0")(x.to("cuda:0"))
        out = model(x.to("cuda:0"))
        assert out.device == torch.device("cuda:0")  # back on the input's device
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
        assert model(x).device.type == "cpu"
    ref.cpu()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from devmap.loading.saver import save

    path = tmp_path_factory.mktemp("tinyllama") / "ckpt"
    save("tinyllama-1.1b", path, dtype="bfloat16", max_shard_size="1GB", seed=0)
    return path


@pytest.fixture(scope="module")
def llama_reference(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).to("cuda:0").eval()
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    del model
    torch.cuda.empty_cache()
    return ids, logits


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_llama_1b_strategies(llama_dir, llama_reference, strategy):
    ids, expected = llama_reference
    before = allocated()
    model = load(str(llama_dir), strategy, max_memory={0: "2GiB", 1: "2GiB"}, dtype="bf16")
    check_placement(model)
    check_memory(model, before)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    # bf16: the same kernels on the same GPU model; allow rounding differences of the split
    torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.05)
    del model
    torch.cuda.empty_cache()


def test_failed_load_holds_no_gpu_memory(llama_dir, monkeypatch):
    import devmap.loading.transfer as transfer

    torch.cuda.empty_cache()
    before = allocated()
    calls = {"n": 0}
    real_read = transfer._read

    def failing_read(*args):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError("simulated I/O error")
        return real_read(*args)

    monkeypatch.setattr(transfer, "_read", failing_read)
    with pytest.raises(OSError):
        load(str(llama_dir), "balanced", max_memory={0: "2GiB", 1: "2GiB"}, dtype="bf16")
    assert allocated() == before


def test_toy_model_trains_across_two_gpus():
    plain = ToyModel()
    placed = ToyModel()
    placed.load_state_dict(plain.state_dict())
    dispatch(placed, {"net1": 0, "relu": 0, "net2": 1})
    assert placed.net2.weight.device == torch.device("cuda:1")
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    for model, dev in ((plain, "cpu"), (placed, "cuda:1")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        out = model(x.to("cuda:0") if dev != "cpu" else x)
        torch.nn.functional.mse_loss(out.to(dev), y.to(dev)).backward()
        opt.step()
    torch.testing.assert_close(placed.net1.weight.cpu(), plain.net1.weight, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(placed.net2.weight.cpu(), plain.net2.weight, atol=1e-5, rtol=1e-5)
