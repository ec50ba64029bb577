"""Host tensors that are views of their checkpoint file (`devmap.loading.file_maps`): no copy where the stored dtype
is the one asked for, a copy otherwise; writing to a loaded model never changes its file."""

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from devmap import load
from devmap.loading.checkpoint import TensorEntry, index_checkpoint
from devmap.loading.file_maps import FileMaps
from devmap.testing import gpu_count

from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("mapped"), "300KB")


def digest(folder: Path) -> str:
    hashes = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        hashes.update(file.read_bytes())
    return hashes.hexdigest()


def test_a_host_load_in_the_stored_dtype_maps_every_tensor_and_reads_none(llama_dir):
    stored = sum(entry.nbytes for entry in index_checkpoint(llama_dir).values())
    model = load(str(llama_dir), "cpu")
    report = model.devmap_load_report
    assert report.mapped_bytes == stored and report.bytes_read == 0
    assert report.to_dict()["mapped_bytes"] == stored


def test_writing_to_a_mapped_model_leaves_its_file_and_a_new_load_unchanged(llama_dir):
    before = digest(llama_dir)
    model = load(str(llama_dir), "cpu")
    weight = model.model.layers[0].mlp.down_proj.weight
    original = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer's in-place step: the page is copied, the file is not written
    assert torch.equal(weight, original + 1.0)
    assert digest(llama_dir) == before
    again = load(str(llama_dir), "cpu")
    assert torch.equal(again.model.layers[0].mlp.down_proj.weight, original)


def test_a_load_into_another_dtype_copies(llama_dir):
    model = load(str(llama_dir), "cpu", dtype="bfloat16")  # the checkpoint holds float32
    report = model.devmap_load_report
    assert report.mapped_bytes == 0 and report.bytes_read > 0
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_bytes_not_aligned_to_their_dtype_are_not_mapped(tmp_path):
    file = tmp_path / "raw.bin"
    file.write_bytes(bytes(range(16)))
    maps = FileMaps()
    odd = TensorEntry("w", file, torch.float32, (2,), start=2, end=10)
    assert maps.view(odd) is None
    even = TensorEntry("w", file, torch.int16, (4,), start=2, end=10)
    assert torch.equal(maps.view(even), torch.frombuffer(bytearray(range(2, 10)), dtype=torch.int16))
    pickled = TensorEntry("w", file, torch.float32, (2,), start=0, end=8, tensor=torch.zeros(2))
    assert maps.view(pickled) is None


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")
def test_blocks_offloaded_to_the_host_run_from_their_mapped_weights_on_the_gpu(llama_dir):
    stored = sum(entry.nbytes for entry in index_checkpoint(llama_dir).values())
    model = load(str(llama_dir), "sequential", max_memory={0: stored // 2, "cpu": "1GiB"})
    assert set(model.hf_device_map.values()) == {0, "cpu"}, model.hf_device_map
    assert 0 < model.devmap_load_report.mapped_bytes < stored
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to("cuda:0")).logits.cpu(), reference(ids).logits, rtol=1e-4, atol=1e-4)
