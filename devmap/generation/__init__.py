"""Generation: LLaMA-style causal LMs run through their stages in lanes, for prefill and token-by-token decoding.

Owns the causal-LM stage view (embedding, layers, norm and head per device), lanes with static KV caches
on every stage, captured decode and prefill steps and their cache on the model, and sampling. Imports
`devmap.pipelining` (its streams), `devmap.planning` and `devmap.errors`. `generate`, `forward`, `timed`
and `check_length` are re-exported here.
"""

from .api import check_length, forward, generate, timed

__all__ = ["check_length", "forward", "generate", "timed"]
