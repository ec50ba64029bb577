"""Loading with quantized Linear layers on the CPU (torchao int8): logits near the bfloat16 model's, plan bytes equal
to what is allocated, greedy lanes equal transformers' generate, and what cannot work refused before loading."""

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import devmap
from devmap.cli import main
from devmap.errors import UsageError
from devmap.loading.quantize import quantized_nbytes
from devmap.planning.quantization import quantized_weights
from devmap.testing import assert_same_greedy_tokens

pytest.importorskip("torchao")  # a test dependency: installed in CI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "tiny"
    subprocess.run([sys.executable, "-m", "devmap", "save", "llama-tiny", str(path), "--dtype", "bfloat16"],
                   check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def int8_model(tiny):
    return devmap.load(tiny, device_map="cpu", quantization="int8")


def test_int8_logits_stay_near_the_bfloat16_model(tiny, int8_model):
    plain = devmap.load(tiny, device_map="cpu", dtype="bfloat16")
    names = quantized_weights(int8_model, int8_model.devmap_plan.quantization)
    assert names and all(type(int8_model.get_parameter(n)).__name__ == "Int8Tensor" for n in names)
    assert int8_model.lm_head.weight.dtype == int8_model.model.norm.weight.dtype == torch.bfloat16
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = plain(ids).logits.float(), int8_model(ids).logits.float()
    # stated tolerance: per-row int8 weights move each logit by under 2% of the largest one
    assert (want - got).abs().max() <= 0.02 * want.abs().max()


def test_a_model_on_one_device_is_quantized_layer_by_layer(tiny, monkeypatch):
    """A device holds one or two layers in full precision beyond its plan while they are quantized, also where the
    whole model is placed on it (`{"": device}`): a 13B int8 model then loads on a GPU of 80 GB."""
    from devmap.loading import quantize
    from devmap.loading.quantize import block_of

    units = {"model.layers.3", "model.layers.12"}  # the modules a plan never splits (decoder layers)
    assert block_of("model.layers.3.mlp.up_proj.weight", {"": 0}, units) == "model.layers.3"
    assert block_of("model.layers.3.mlp.up_proj.weight", {"model.layers.3.mlp": 0, "": 1}, units) == \
        "model.layers.3.mlp"
    assert block_of("model.layers.12.self_attn.q_proj.weight", {"model.layers.12": 0}, units) == "model.layers.12"
    assert block_of("model.layers.12.mlp.experts.7.up_proj.weight", {"": 0}, units) == "model.layers.12"
    assert block_of("lm_head.weight", {"": 0}, units) == ""
    assert block_of("lm_head.weight", {"lm_head": 1}, units) == "lm_head"
    groups = []
    quantize_linears = quantize.quantize_linears
    monkeypatch.setattr(quantize, "quantize_linears", lambda model, names, q: groups.append(names) or
                        quantize_linears(model, names, q))
    model = devmap.load(tiny, device_map="cpu", quantization="int8")
    assert model.devmap_plan.device_map == {"": "cpu"}
    assert len(groups) == len(model.model.layers)
    assert all({name.split(".")[2] for name in names} == {str(i)} for i, names in enumerate(groups))


def test_a_quantized_load_leaves_inductors_settings_alone(tiny):
    """torchao's configs turn on coordinate-descent autotuning for the whole process unless told not to; a load
    must not change how later compiles of any model run."""
    from torch._inductor import config

    from devmap.loading.quantize import torchao_config
    from devmap.planning.quantization import parse_quantization

    settings = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")
    with config.patch({name: False for name in settings}):
        devmap.load(tiny, device_map="cpu", quantization="int8")
        assert not any(getattr(config, name) for name in settings)
    assert not torchao_config(parse_quantization("int4")).set_inductor_config


def test_plans_count_the_rotary_buffers_a_load_allocates(tiny, int8_model):
    """Plan bytes are the bytes a load allocates, buffers included: the rotary embedding's inv_freq and
    original_inv_freq stay float32 in a bfloat16 model, and the plan counts them so."""
    plain = devmap.load(tiny, device_map="cpu", dtype="bfloat16")
    buffers = sum(b.numel() * b.element_size() for b in plain.buffers())
    assert plain.model.rotary_emb.original_inv_freq.dtype == torch.float32
    assert plain.devmap_plan.total_bytes == sum(p.numel() * p.element_size() for p in plain.parameters()) + buffers
    assert int8_model.devmap_plan.total_bytes == quantized_nbytes(int8_model) + buffers


def test_greedy_lanes_equal_transformers_generate_on_the_quantized_model(int8_model):
    ids = torch.randint(3, 500, (4, 10), generator=torch.Generator().manual_seed(1))
    ours = devmap.generate(int8_model, ids, max_new_tokens=6, lanes=2)
    theirs = int8_model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(ours[:, :theirs.shape[1]], theirs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map="cpu", quantization="int4"), "runs on GPUs only"),
    (dict(max_memory="cpu=100KB,disk=1GB", quantization="int8"), "cannot be offloaded to disk"),
    (dict(device_map="cpu", quantization="int8", dtype="float32"), "use --dtype bfloat16 or float16"),
])
def test_what_cannot_work_is_refused_before_loading(tiny, tmp_path, kwargs, message):
    with pytest.raises(UsageError, match=message):
        devmap.load(tiny, offload_folder=tmp_path / "off", **kwargs)
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())


def test_bitsandbytes_4bit_config_needs_gpus(tiny):
    from transformers import BitsAndBytesConfig

    with pytest.raises(UsageError, match="runs on GPUs only"):
        devmap.load(tiny, device_map="cpu",
                    quantization=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))


def test_resnet_is_refused():
    with pytest.raises(UsageError, match="LLaMA-style"):
        devmap.load("resnet18", device_map="cpu", quantization="int8")


def test_cli_load_and_generate_quantized(tiny):
    result = CliRunner().invoke(main, ["load", str(tiny), "--device-map", "cpu", "--quantize", "int8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["plan"]["quantization"]["scheme"] == "int8"
    result = CliRunner().invoke(main, ["generate", str(tiny), "--device-map", "cpu", "--quantize", "int8",
                                       "--batch-size", "2", "--prompt-len", "8", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output


def test_same_weights_and_tokens_as_transformers_with_torchao(tiny, int8_model):
    """transformers' from_pretrained(quantization_config=TorchAoConfig(Int8WeightOnlyConfig())) on the same
    checkpoint: the same stored int8 weights and scales, the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from devmap.compat import stored_tensors
    from devmap.loading.quantize import transformers_config

    config = transformers_config(int8_model.devmap_plan.quantization, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=config, dtype=torch.bfloat16,
                                                  device_map="cpu")
    ours = dict(int8_model.named_parameters())
    for name, param in theirs.named_parameters():
        assert type(ours[name]) is type(param), name
        assert all(torch.equal(a, b) for a, b in zip(stored_tensors(ours[name]), stored_tensors(param), strict=True))
    ids = torch.randint(3, 500, (4, 10), generator=torch.Generator().manual_seed(2))
    want = theirs.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    assert torch.equal(int8_model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False), want.sequences)
    assert_same_greedy_tokens(devmap.generate(int8_model, ids, max_new_tokens=6), want, ids.shape[1])


def test_saved_quantized_checkpoint_is_read_back_by_transformers(tiny, int8_model, tmp_path):
    """`devmap save --quantize int8` writes torchao's layout with a quantization_config: transformers'
    from_pretrained reads the same stored weights and computes the same logits; devmap refuses to load it
    (it quantizes full-precision checkpoints itself) with a reason."""
    from transformers import AutoModelForCausalLM

    from devmap.compat import stored_tensors

    out = tmp_path / "int8"
    result = CliRunner().invoke(main, ["save", "llama-tiny", str(out), "--weights", str(tiny / "model.safetensors"),
                                       "--quantize", "int8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quantization"] == "int8"
    assert [p.name for p in tmp_path.iterdir()] == ["int8"]  # no temporary folder left beside it
    theirs = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    ours = dict(int8_model.named_parameters())
    for name, param in theirs.named_parameters():
        assert all(torch.equal(a, b) for a, b in zip(stored_tensors(ours[name]), stored_tensors(param), strict=True))
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, int8_model(ids).logits)
    refused = CliRunner().invoke(main, ["load", str(out)])
    assert refused.exit_code == 2 and "pre-quantized" in refused.output
