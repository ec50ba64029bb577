"""The KV cache a model's serving memory plan made room for, as a budget of cache tokens.

A plan makes room for its largest batch at the longest cache a request within the limits may need (`rows` rows of
`cache_len` tokens). A batch whose requests need shorter caches holds more rows in the same tokens, as vLLM's
scheduler admits sequences while KV blocks remain: the budget is rows × cache tokens, not a row count.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVBudget:
    """`rows` rows of `cache_len` cache tokens each: what a model's serving plan holds in KV caches; its batches run
    in `lanes` lanes (one per pipeline stage), each of up to the service's `max_batch` rows."""

    rows: int
    cache_len: int
    lanes: int = 1

    @property
    def tokens(self) -> int:
        """Cache tokens in all (per layer)."""
        return self.rows * self.cache_len

    def rows_at(self, cache_len: int) -> int:
        """The most rows of `cache_len` cache tokens within the budget (at least the plan's rows: a cache is never
        longer than the plan's)."""
        return max(self.rows, self.tokens // max(cache_len, 1))
