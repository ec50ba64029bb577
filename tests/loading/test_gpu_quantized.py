"""GPU-only: int8 and int4 (torchao) and nf4 (bitsandbytes) over two GPUs: logits near bfloat16, plan bytes equal
the bytes allocated, and the lanes' greedy tokens equal transformers' generate on the same quantized model."""

import pytest
import torch

import devmap
from devmap.loading.quantize import quantized_nbytes
from devmap.testing import require_gpus

pytestmark = require_gpus(2)
LIBRARY = {"int8": "torchao", "int4": "torchao", "nf4": "bitsandbytes"}


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


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_quantized_over_two_gpus(small, scheme):
    pytest.importorskip(LIBRARY[scheme])
    plain = devmap.load(small, device_map="balanced", dtype="bfloat16")
    model = devmap.load(small, device_map="balanced", quantization=scheme)
    assert {0, 1} <= set(model.hf_device_map.values())
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    with torch.no_grad():
        want, got = plain(ids).logits.float(), model(ids).logits.float()
    limit = 0.02 if scheme == "int8" else 0.15  # 4-bit weights move logits more
    assert (want - got).abs().max() <= limit * want.abs().max()
    buffers = plain.devmap_plan.total_bytes - sum(p.numel() * p.element_size() for p in plain.parameters())
    assert model.devmap_plan.total_bytes == quantized_nbytes(model) + buffers
    ours = devmap.generate(model, ids, max_new_tokens=6)
    theirs = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(ours[:, :theirs.shape[1]].cpu(), theirs.cpu())
