"""Tensor parallelism as planning sees it: a LLaMA-family model split N ways inside each group of N GPUs.

Every GPU of a group holds 1/N of each attention and MLP block (column-parallel q/k/v and gate/up, row-parallel o and
down: the KV heads split too, so each GPU's KV cache holds its own heads only), the embedding and the head split by
vocabulary where N divides it (each GPU reads 1/N of the head per token), and the norms whole. Groups of N GPUs in
index order are the pipeline's stages: `--tensor-parallel 2` on four GPUs gives two stages of two GPUs each.

One GPU of a group holds exactly the model a *local config* describes (attention heads, KV heads, intermediate size
and, where split, the vocabulary divided by N; the head size kept), so the planner plans that model over one budget
per group (its smallest GPU's), the runtime's KV caches follow from the same config, and `TensorSplit.slice_of` says
which slice of a full checkpoint tensor each GPU holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .budget import Budget
from ..errors import UsageError

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by outputs (weight rows)
ROW_PARALLEL = ("o_proj", "down_proj")  # split by inputs (weight columns); their outputs are summed over the group
VOCABULARY = ("embed_tokens", "lm_head")  # split by vocabulary rows where N divides the vocabulary


@dataclass(frozen=True)
class TensorSplit:
    """How a model is split: `size` GPUs per group, `groups` the GPU indices of each group (a pipeline stage each),
    `vocab` whether the embedding and head are split by vocabulary (else whole on every GPU)."""

    size: int
    groups: tuple[tuple[int, ...], ...]
    vocab: bool

    def slice_of(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
        """(dimension, start, stop) of the full tensor `name` of `shape` that the group's GPU `rank` holds; None
        where every GPU holds it whole (norms, rotary buffers, an embedding the vocabulary does not split)."""
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf in COLUMN_PARALLEL or (self.vocab and leaf in VOCABULARY):
            dim = 0
        elif leaf in ROW_PARALLEL and kind == "weight" and len(shape) == 2:
            dim = 1
        else:
            return None
        part = shape[dim] // self.size
        return dim, rank * part, (rank + 1) * part

    def group_of(self, gpu: int) -> tuple[int, ...]:
        """The group `gpu` belongs to: its GPUs, process 0's first (process r holds the r-th)."""
        return next(g for g in self.groups if gpu in g)

    def label(self, gpu: int) -> str:
        """The group whose first GPU is `gpu`, as "cuda:0-1" (consecutive) or "cuda:0,2"."""
        group = self.group_of(gpu)
        consecutive = list(group) == list(range(group[0], group[0] + len(group)))
        return f"cuda:{group[0]}-{group[-1]}" if consecutive else "cuda:" + ",".join(map(str, group))

    def describe(self) -> str:
        """One line: what each GPU holds and which groups are the stages."""
        parts = "every attention and MLP block (its own KV heads) and of the embedding and head (by vocabulary)" \
            if self.vocab else "every attention and MLP block (its own KV heads); the embedding and head whole"
        stages = ", ".join(self.label(g[0]) for g in self.groups)
        return (f"Tensor parallel {self.size}: each GPU holds 1/{self.size} of {parts}; "
                f"{'the pipeline stages are' if len(self.groups) > 1 else 'one group'} {stages}")

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "groups": [list(g) for g in self.groups], "vocab_split": self.vocab}


def check_split(source: Any, size: int) -> bool:
    """Refuse, in one line, a model (`source`, a resolved ModelSource) that `size` does not split: not a LLaMA-family
    language model, or heads, KV heads or the MLP's intermediate size not divisible by `size`. Returns whether the
    vocabulary splits too."""
    config, name = (source.config if source.is_causal_lm else None), source.name
    fields = ("num_attention_heads", "intermediate_size", "hidden_size")
    if config is None or any(not isinstance(getattr(config, f, None), int) for f in fields):
        raise UsageError(f"tensor parallelism splits LLaMA-family language models (attention heads and an MLP); "
                         f"{name} is not one: run it without tensor parallelism")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise UsageError(f"{name} has biases on its projections, which devmap's tensor parallelism does not split: "
                         "run it without tensor parallelism")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads, "KV heads": kv_heads, "MLP intermediate size": config.intermediate_size}
    undivided = [f"{value} {label}" for label, value in sizes.items() if value % size]
    if undivided:
        fits = [n for n in range(1, 9) if all(v % n == 0 for v in sizes.values())]
        listed = ", ".join(undivided[:-1]) + " and " + undivided[-1] if len(undivided) > 1 else undivided[0]
        raise UsageError(f"--tensor-parallel {size} does not divide {name}'s {listed}: use one of "
                         f"{', '.join(map(str, fits))}")
    return config.vocab_size % size == 0


def local_config(config: Any, size: int, vocab: bool) -> Any:
    """The config of the model one GPU of a group holds: heads, KV heads and intermediate size (and the vocabulary,
    when split) divided by `size`, the head size kept."""
    heads = config.num_attention_heads
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local.num_attention_heads = heads // size
    local.num_key_value_heads = (getattr(config, "num_key_value_heads", None) or heads) // size
    local.intermediate_size = config.intermediate_size // size
    if vocab:
        local.vocab_size = config.vocab_size // size
    return local


def shard_source(source: Any, size: int) -> tuple[Any, bool]:
    """The source (a ModelSource) of the model one GPU of a split of `size` holds, and whether its vocabulary is
    split: `check_split`, then `local_config`."""
    vocab = check_split(source, size)
    return source.with_config(local_config(source.config, size, vocab)), vocab


def group_budget(budget: Budget, size: int) -> tuple[Budget, tuple[tuple[int, ...], ...]]:
    """One budget per group of `size` GPUs (in index order), each its smallest GPU's, and the groups. Tensor
    parallelism runs every block on GPUs: cpu and disk budgets are left out."""
    gpus = [g for g in budget.gpus if isinstance(g, int)]
    if not gpus:
        raise UsageError("tensor parallelism splits blocks over GPUs, and the budget has none: give --gpus N "
                         "--gpu-memory SIZE to simulate them, or run where GPUs are visible")
    if len(gpus) % size:
        raise UsageError(f"--tensor-parallel {size} groups the GPUs {size} at a time, and the budget has "
                         f"{len(gpus)}: use a multiple of {size} GPUs")
    groups = tuple(tuple(gpus[i:i + size]) for i in range(0, len(gpus), size))
    limits = {g: min(budget.limits[m] for m in members) for g, members in enumerate(groups)}
    return Budget(limits, budget.simulated), groups

