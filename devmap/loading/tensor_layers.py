"""The layers of one process's shard of a tensor-parallel model: where the group's partial results meet.

Column-parallel projections (q/k/v, gate/up) need nothing: each process computes its own heads and its own columns of
the MLP. A row-parallel projection (o, down) computes a partial sum of the full output, and an all-reduce over the
group adds them. The embedding split by vocabulary looks up the ids of its own rows (zeros for the others) and an
all-reduce adds them; the head split by vocabulary computes its rows' logits and an all-gather puts the vocabulary
back together, so every process holds the same logits and picks the same tokens (greedy, or sampled from one seed).

The layers are the shard's own `nn.Linear` and `nn.Embedding` modules with their class changed (`parallelize`): the
weights stay where the loader put them, and transformers' forward, devmap's stages and torch.compile call them as
they call any module. The collectives are torch.distributed's own, over the group the loader gave each layer's
device (a shard spread over pipeline stages has one group per stage: an NCCL communicator runs on one GPU).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..errors import UsageError
from ..planning.tensor_parallel import COLUMN_PARALLEL, ROW_PARALLEL, VOCABULARY, TensorSplit


class RowParallelLinear(nn.Linear):
    """A projection holding some of its input columns: its partial products summed over the group."""

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding the vocabulary rows [start, start + num_embeddings): ids outside them look up zeros,
    and the group's lookups are summed."""

    group: Any
    start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Linear):
    """A head holding some vocabulary rows: every process's logits gathered, in vocabulary order."""

    group: Any

    @property  # type: ignore[override]
    def out_features(self) -> int:
        """The whole vocabulary: what the gathered logits hold (`weight` holds this process's rows only)."""
        return self.weight.shape[0] * dist.get_world_size(self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def parallelize(model: nn.Module, split: TensorSplit, rank: int, groups: Mapping[torch.device, Any]) -> None:
    """Turn the shard's row-parallel projections, and where the vocabulary is split its embedding and head, into
    the layers above, each over the group of its device (`groups`: one per pipeline stage, in each of which this
    process is `rank`)."""
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in ROW_PARALLEL:
            module.__class__ = RowParallelLinear
        elif split.vocab and leaf == "embed_tokens":
            module.__class__ = VocabParallelEmbedding
            module.start = rank * module.num_embeddings
        elif split.vocab and leaf == "lm_head":
            module.__class__ = VocabParallelHead
        else:
            continue
        module.group = groups[module.weight.device]


def check_plain(model: nn.Module) -> None:
    """Refuse a model whose split layers are not plain `nn.Linear` / `nn.Embedding` modules (one line)."""
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        plain = nn.Embedding if leaf == "embed_tokens" else nn.Linear
        if leaf in (*COLUMN_PARALLEL, *ROW_PARALLEL, *VOCABULARY) and type(module) is not plain:
            raise UsageError(f"{name} is a {type(module).__name__}, not a plain {plain.__name__}: tensor "
                             "parallelism splits plain layers only")
