"""Tiny LLaMA checkpoints written by transformers' own save_pretrained, for the loading tests."""

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)


def write_tiny_llama(path: Path, max_shard_size: str, **changes) -> Path:
    """A seeded tiny LLaMA (TINY with `changes`) saved into `path` by transformers, sharded at `max_shard_size`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, **changes})).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def copy_checkpoint(source: Path, tmp_path: Path) -> Path:
    """A copy of a checkpoint directory that a test may damage."""
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target
