"""Tensor parallelism on CPU: two gloo processes, each loading its shard of a saved llama-tiny, give the logits and
the greedy and sampled tokens of the whole model in one process (the GPU run of the same is a GPU test)."""

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import devmap
import devmap.generation
from devmap.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the spawned processes import tests.distributed.tensor_ranks
    sys.path.insert(0, str(ROOT))

from tests.distributed.tensor_ranks import run_random_rank, run_rank  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["tied, vocabulary split", "untied, vocabulary whole"])
def checkpoint(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("tp") / "tiny"
    if request.param.startswith("tied"):
        devmap.save("llama-tiny", path, seed=4)
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=511, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """One thread while the test runs (as each rank's process), the count before it after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_processes_give_the_whole_models_outputs(checkpoint, tmp_path, one_thread):
    whole = devmap.load(checkpoint, "cpu", dtype="float32")
    ids = torch.tensor([[5, 17, 300, 2, 41, 9], [7, 7, 480, 33, 1, 12]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        logits = whole(ids, attention_mask=mask).logits
    forward = devmap.generation.forward(whole, ids, mask)
    greedy = devmap.generate(whole, ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    sampled = devmap.generate(whole, ids, mask, max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, seed=3,
                              eos_token_id=[], pad_token_id=0)
    mp.spawn(run_rank, args=(2, free_port(), str(checkpoint), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for got in ranks:
        assert got["heads"] == whole.config.num_attention_heads // 2  # each process holds half the heads
        torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["forward"], forward, atol=1e-5, rtol=1e-5)
        assert torch.equal(got["greedy"], greedy) and torch.equal(got["lanes"], greedy)
        assert torch.equal(got["stages"], greedy)  # tensor parallel inside, two pipeline stages across
        assert torch.equal(got["sampled"], sampled)
    reports = [got["report"] for got in ranks]
    whole_bytes = whole.devmap_load_report.bytes_read + whole.devmap_load_report.mapped_bytes
    assert all(r["bytes_read"] < whole_bytes for r in reports)  # each its own slices


def test_random_weights_held_whole_are_the_same_in_every_process(checkpoint, tmp_path):
    # `--load-format dummy`: processes whose whole copies (norms, an embedding and head the vocabulary does not
    # split) differed would compute different tokens, and a split service's processes would fall out of step
    mp.spawn(run_random_rank, args=(2, free_port(), str(checkpoint), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"random{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["whole"].keys() == ranks[1]["whole"].keys()
    vocabulary_whole = json.loads((checkpoint / "config.json").read_text())["vocab_size"] % 2 == 1
    assert ("model.embed_tokens.weight" in ranks[0]["whole"]) == vocabulary_whole
    for name, tensor in ranks[0]["whole"].items():
        assert torch.equal(tensor, ranks[1]["whole"][name]), name
    assert torch.equal(ranks[0]["greedy"], ranks[1]["greedy"])


def test_a_split_without_its_processes_is_refused(checkpoint, monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(UsageError, match="start 2 of them with `torchrun --nproc-per-node 2`"):
        devmap.load(checkpoint, tensor_parallel=2)
    with pytest.raises(UsageError, match="leave out device_map, quantization"):
        devmap.load(checkpoint, "cpu", tensor_parallel=2, quantization="int8")
    with pytest.raises(UsageError, match="positive integer"):
        devmap.load(checkpoint, tensor_parallel=0)


def test_devmap_generate_starts_its_processes_and_reports_the_whole_models_text(tmp_path):
    """`devmap generate --tensor-parallel 2` starts two processes itself; rank 0 alone prints the text one process
    generates from the whole model."""
    import json
    import os
    import subprocess

    from click.testing import CliRunner

    from devmap.cli import main

    path = tmp_path / "tiny"
    devmap.save("llama-tiny", path, seed=6)
    args = ["generate", str(path), "--prompt", "The GPUs work together", "--batch-size", "1", "--max-new-tokens", "6",
            "--json"]
    whole = CliRunner().invoke(main, [*args, "--device-map", "cpu"])
    assert whole.exit_code == 0, whole.output
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    split = subprocess.run([sys.executable, "-m", "devmap", *args, "--tensor-parallel", "2"], capture_output=True,
                           text=True, env=env, timeout=300)
    assert split.returncode == 0, split.stderr
    got = json.loads(split.stdout)  # one object: the other rank prints nothing
    assert got["text"] == json.loads(whole.output)["text"] and got["tensor_parallel"] == 2
    bad = subprocess.run([sys.executable, "-m", "devmap", *args, "--tensor-parallel", "3"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not divide" in bad.stderr


def test_a_split_that_does_not_fit_ends_every_process_with_process_0s_reason(tmp_path):
    """Process 0 plans the split for all; a plan that fails there ends every process with its reason (one line, the
    error's exit code), none waiting for a plan that never comes."""
    import json
    import os
    import subprocess

    path = tmp_path / "huge"
    devmap.save("llama-tiny", path, config_only=True)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=200, num_attention_heads=128,
                  num_key_value_heads=8)  # ~1.5 TB in bfloat16: no host holds half of it
    (path / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT)}.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-m", "devmap", "generate", str(path), "--prompt", "Hello", "--batch-size",
                          "1", "--max-new-tokens", "2", "--tensor-parallel", "2", "--dtype", "bfloat16"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "split 2 ways does not fit" in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1  # rank 0 alone says it
