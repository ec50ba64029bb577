"""GPU-only: a float32 LLaMA split 2 and 4 ways over NCCL (and 2 ways on 4 GPUs: two pipeline stages of two GPUs,
each process holding its GPU of both), gives the logits (of the model and of `devmap.generation.forward`) and
greedy tokens of the whole model on one GPU (CUDA graphs capturing the collectives), and every process the same
sampled tokens."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

import devmap
import devmap.generation
from devmap.testing import gpu_count, require_gpus

from .tensor_ranks import run_rank

pytestmark = require_gpus(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size, gpus", [(2, 2), (4, 4), (2, 4)])
def test_gpus_splitting_a_model_give_one_gpus_logits_and_tokens(tmp_path, size, gpus):
    if gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {gpu_count()} visible")
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(7)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    torch.backends.cuda.matmul.allow_tf32 = False  # restored by conftest's _float32_products
    whole = devmap.load(tmp_path / "model", 0, dtype="float32")
    ids = torch.tensor([[5, 17, 300, 2, 41, 9], [7, 7, 480, 33, 1, 12]], device="cuda:0")
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        logits = whole(ids, attention_mask=mask).logits.cpu()
    forward = devmap.generation.forward(whole, ids, mask).cpu()
    greedy = devmap.generate(whole, ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    del whole
    ranks = mp.spawn(run_rank, args=(size, free_port(), str(tmp_path / "model"), str(tmp_path), gpus), nprocs=size,
                     join=False)
    if not ranks.join(timeout=300):  # their results are written before the group goes; a hang there is not ours
        for process in ranks.processes:
            process.kill()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(size)]
    assert [got["device"] for got in ranks] == [f"cuda:{r}" for r in range(size)]
    # on a multiple of N GPUs each process holds its GPU of every group of N (the groups are the pipeline's stages)
    assert [got["devices"] for got in ranks] == [[f"cuda:{g}" for g in range(r, gpus, size)] for r in range(size)]
    for got in ranks:
        assert got["heads"] == 8 // size
        torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got["forward"], forward, atol=1e-4, rtol=1e-4)
        assert torch.equal(got["greedy"], greedy) and torch.equal(got["lanes"], greedy)
        assert torch.equal(got["sampled"], ranks[0]["sampled"])  # the processes stay in step
