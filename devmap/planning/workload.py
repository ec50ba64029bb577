"""What a model will run, for planning the memory running needs beside its weights: the kind of work and its
shapes, validated once here (the CLI's and the Python API's boundary).

- `inference`: forward passes of `batch` rows in `chunks` micro-batches (a LLaMA: `seq_len` tokens per row;
  a vision model: one sample of `input_shape`);
- `generate` and `serve`: a LLaMA generating up to `seq_len` tokens per row (prompt + new), `batch` rows, with a
  KV cache of `seq_len` tokens per row on every layer's device; its prompts prefilled in `chunks` lanes, or (serve)
  in joining packs of at most `prefill_rows` × `seq_len` tokens, whose keys and values go through a scratch cache
  of that many tokens before they reach their rows, and whose captured steps (`captured_tokens` over all their
  widths) keep their input and output hidden states;
- `train`: forward and backward of `batch` rows in `chunks` micro-batches, with gradients and `optimizer` state.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

KINDS = ("inference", "generate", "train", "serve")
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}  # state tensors per parameter
DEFAULT_SAMPLE = (3, 224, 224)


@dataclass(frozen=True)
class Workload:
    """One workload's kind and shapes (see the module docstring)."""

    kind: str
    batch: int = 1
    seq_len: int = 0
    input_shape: tuple[int, ...] = ()
    chunks: int = 1
    optimizer: str = "adamw"
    prefill_rows: int = 0  # serve: rows of the largest joining prefill (0: prompts are prefilled by lanes)
    captured_tokens: int = 0  # serve: tokens of every joining prefill shape captured, each keeping its hidden states

    @property
    def micro_batch(self) -> int:
        """Rows of one micro-batch (or lane)."""
        return -(-self.batch // self.chunks)

    @property
    def prefill_batch(self) -> int:
        """Rows prefilled at once: a micro-batch's (lane's), or a joining pack's tokens in rows of `seq_len`."""
        return self.prefill_rows or self.micro_batch

    def describe(self) -> str:
        """"generate 32 × 2048 tokens", "train 256 × 3×224×224 in 4 micro-batches"."""
        rows = f"{self.batch} × " + (f"{self.seq_len} tokens" if self.seq_len else "×".join(map(str, self.input_shape)))
        split = f" in {self.chunks} {'lanes' if self.seq_len else 'micro-batches'}" if self.chunks > 1 else ""
        return f"{self.kind} {rows}{split}"

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "batch": self.batch, "seq_len": self.seq_len or None,
                "input_shape": list(self.input_shape) or None, "chunks": self.chunks,
                "optimizer": self.optimizer if self.kind == "train" else None,
                "prefill_rows": self.prefill_rows or None, "captured_tokens": self.captured_tokens or None}


def parse_workload(kind: str, *, causal_lm: bool, context: int = 0, batch: int = 1, seq_len: int | None = None,
                   input_shape: tuple[int, ...] | None = None, chunks: int = 1,
                   optimizer: str = "adamw", prefill_rows: int = 0, captured_tokens: int = 0) -> Workload:
    """A validated Workload for a model (`causal_lm`: a LLaMA-style model whose context is `context` tokens, 0 if
    unknown); a UsageError names the first bad field and what is accepted."""
    kind = str(kind).strip().lower()
    if kind not in KINDS:
        raise UsageError(f"unknown workload {kind!r}: use one of {', '.join(KINDS)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise UsageError(f"batch must be a positive number of rows, got {batch!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= batch:
        raise UsageError(f"chunks must be between 1 and the batch ({batch}), got {chunks!r}")
    optimizer = str(optimizer).strip().lower()
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATES)}")
    if isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int) or not 0 <= prefill_rows <= batch:
        raise UsageError(f"prefill_rows must be between 0 and the batch ({batch}), got {prefill_rows!r}")
    if (prefill_rows or captured_tokens) and kind != "serve":
        raise UsageError("prefill_rows and captured_tokens describe a service's joining prefills: use them with the "
                         "serve workload")
    if isinstance(captured_tokens, bool) or not isinstance(captured_tokens, int) or captured_tokens < 0:
        raise UsageError(f"captured_tokens must be a number of tokens, got {captured_tokens!r}")
    if kind in ("generate", "serve") and not causal_lm:
        raise UsageError(f"--for {kind} plans a LLaMA-style causal LM; for this model use --for inference or train")
    if causal_lm:
        if input_shape is not None:
            raise UsageError("a causal LM's inputs are tokens: give --seq-len (tokens per row), not --input-shape")
        if seq_len is None:
            raise UsageError(f"--for {kind} on a causal LM needs --seq-len (tokens per row: prompt + new tokens)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise UsageError(f"seq_len must be a positive number of tokens, got {seq_len!r}")
        if context and seq_len > context:
            raise UsageError(f"seq_len {seq_len} is longer than the model's context of {context} tokens")
        return Workload(kind, batch, seq_len, (), chunks, optimizer, prefill_rows, captured_tokens)
    if seq_len is not None:
        raise UsageError("--seq-len is for causal LMs; give this model's --input-shape (one sample, e.g. 3,224,224)")
    shape = tuple(input_shape) if input_shape is not None else DEFAULT_SAMPLE
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise UsageError(f"input_shape must be one sample's positive sizes, e.g. 3,224,224; got {input_shape!r}")
    return Workload(kind, batch, 0, shape, chunks, optimizer)
