"""GPU-only: int8, int4 and fp8 (torchao) and nf4 (bitsandbytes) over two GPUs: logits near bfloat16, plan bytes
equal the bytes allocated, and the lanes' greedy tokens equal transformers' generate on the same quantized model (fp8
on GPUs with FP8 tensor cores only)."""

import pytest
import torch

import devmap
from devmap.compat import stored_tensors
from devmap.loading.quantize import quantized_nbytes
from devmap.testing import assert_same_greedy_tokens, require_gpus

pytestmark = require_gpus(2)
LIBRARY = {"int8": "torchao", "int4": "torchao", "nf4": "bitsandbytes", "fp8": "torchao"}
TOLERANCE = {"int8": 0.03, "int4": 0.30, "nf4": 0.30, "fp8": 0.10}  # relative RMS error of the logits


def needs(scheme: str) -> None:
    """Skip where the scheme's library is missing, or fp8 where the GPUs have no FP8 tensor cores."""
    pytest.importorskip(LIBRARY[scheme])
    if scheme == "fp8" and min(torch.cuda.get_device_capability(i) for i in range(2)) < (8, 9):
        pytest.skip("fp8 needs GPUs of compute capability 8.9 and up")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A LLaMA with hidden size 256 (int4's groups of 128 and nf4's blocks of 64 divide its rows), saved by
    transformers in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("q") / "small"
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4", "fp8"])
def test_quantized_over_two_gpus(small, scheme):
    needs(scheme)
    plain = devmap.load(small, device_map="balanced", dtype="bfloat16")
    model = devmap.load(small, device_map="balanced", quantization=scheme)
    assert {0, 1} <= set(model.hf_device_map.values())
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    with torch.no_grad():
        want, got = plain(ids).logits.float(), model(ids).logits.float()
    # stated tolerance, as relative RMS error of the logits: 3% for int8, 10% for fp8 (its activations in 8 bits
    # too), 30% for 4-bit (this model's weights are random N(0, 0.02), the worst case for 4-bit grids; trained
    # weights lose far less)
    error = float((want - got).norm() / want.norm())
    assert error <= TOLERANCE[scheme], f"{scheme}: relative RMS error {error:.3f}"
    buffers = plain.devmap_plan.total_bytes - sum(p.numel() * p.element_size() for p in plain.parameters())
    assert model.devmap_plan.total_bytes == quantized_nbytes(model) + buffers
    theirs = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6, output_scores=True,
                            return_dict_in_generate=True)
    assert_same_greedy_tokens(devmap.generate(model, ids, max_new_tokens=6), theirs, ids.shape[1])


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4", "fp8"])
def test_same_as_transformers_with_the_same_library(small, scheme):
    """transformers' from_pretrained(quantization_config=...) on the same checkpoint and device map: the same
    stored weights after quantization, the same greedy tokens."""
    needs(scheme)
    from transformers import AutoModelForCausalLM

    from devmap.loading.quantize import transformers_config

    model = devmap.load(small, device_map="balanced", quantization=scheme)
    config = transformers_config(model.devmap_plan.quantization, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(small, quantization_config=config, dtype=torch.bfloat16,
                                                  device_map=dict(model.hf_device_map))
    ours_params = dict(model.named_parameters())
    quantized = 0
    for name, param in theirs.named_parameters():
        mine = ours_params[name]
        assert type(mine) is type(param), name
        for a, b in zip(stored_tensors(mine), stored_tensors(param), strict=True):
            assert a.device == b.device and torch.equal(a, b), name
        quantized += name.endswith("proj.weight")
    assert quantized == 4 * 7
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(1)).to("cuda:0")
    want = theirs.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    assert torch.equal(model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False), want.sequences)
    assert_same_greedy_tokens(devmap.generate(model, ids, max_new_tokens=8), want, ids.shape[1])


@pytest.mark.parametrize("scheme", ["int4", "nf4", "fp8"])
def test_saved_gpu_only_checkpoint_is_read_back_by_transformers(small, scheme, tmp_path):
    """What `devmap save --quantize` writes (write_quantized; the CLI path is tested on the CPU with int8):
    transformers' from_pretrained reads the same stored 4-bit or fp8 weights and computes the same logits."""
    needs(scheme)
    from transformers import AutoModelForCausalLM

    from devmap.loading.quantized_saver import write_quantized

    model = devmap.load(small, device_map="balanced", quantization=scheme)
    write_quantized(model, tmp_path, 2**30)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=dict(model.hf_device_map))
    ours = dict(model.named_parameters())
    for name, param in theirs.named_parameters():
        assert all(torch.equal(a, b) for a, b in zip(stored_tensors(ours[name]), stored_tensors(param), strict=True))
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(3)).to("cuda:0")
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, model(ids).logits)
