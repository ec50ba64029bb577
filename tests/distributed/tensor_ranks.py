"""What each process of the tensor-parallel tests runs (spawned, so importable by name): its shard of a saved
checkpoint, then the full model's outputs from the shards working together, saved for the test to compare. Each
process ends as devmap's own ranks do (`end_launched_rank`): without the interpreter's teardown, where gloo's threads
abort a process that has finished ("terminate called without an active exception", about one run in fifty)."""

import os
from pathlib import Path

import torch

from devmap.cli.rank_launch import end_launched_rank


def run_rank(rank: int, size: int, port: int, checkpoint: str, out: str, gpus: int = 0) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if gpus:  # the GPUs this split may use (before CUDA starts in this process)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products as the whole model's
    import devmap
    import devmap.generation

    model = devmap.load(checkpoint, tensor_parallel=size, dtype="float32")
    device = next(model.parameters()).device
    ids = torch.tensor([[5, 17, 300, 2, 41, 9], [7, 7, 480, 33, 1, 12]], device=device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.cpu()
    results = {
        "logits": logits,
        "forward": devmap.generation.forward(model, ids, mask).cpu(),  # the head's gathered vocabulary, batched
        "greedy": devmap.generate(model, ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0),
        "lanes": devmap.generate(model, ids, mask, max_new_tokens=8, lanes=2, eos_token_id=[], pad_token_id=0),
        # two pipeline stages of the split model (on one device here), their lanes' collectives interleaved
        "stages": devmap.generate(model, ids, mask, max_new_tokens=8, lanes=2, split_layers=[1], eos_token_id=[],
                                  pad_token_id=0) if model.device.type == "cpu" else None,
        "sampled": devmap.generate(model, ids, mask, max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20,
                                   seed=3, eos_token_id=[], pad_token_id=0),
        "heads": model.config.num_attention_heads,
        "device": str(device),
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "report": model.devmap_load_report.to_dict(),
    }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    devmap.release_graphs(model)  # before the group goes: a captured collective can hang it (pytorch#115388)
    torch.distributed.destroy_process_group()
    end_launched_rank(0)


def run_random_rank(rank: int, size: int, port: int, checkpoint: str, out: str) -> None:
    """This process's shard of random weights made from the checkpoint's config alone (`--load-format dummy`): the
    tensors it holds whole, and its greedy tokens."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import devmap

    model = devmap.load(checkpoint, tensor_parallel=size, dtype="float32", random_weights=True)
    split = model.devmap_plan.tensor_parallel
    whole = {name: p.detach().clone() for name, p in model.named_parameters()
             if split.slice_of(name, tuple(p.shape), rank) is None}
    ids = torch.tensor([[5, 17, 300, 2, 41, 9]])
    greedy = devmap.generate(model, ids, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    torch.save({"whole": whole, "greedy": greedy}, Path(out) / f"random{rank}.pt")
    torch.distributed.destroy_process_group()
    end_launched_rank(0)
