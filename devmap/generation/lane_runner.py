"""The engine of pipelined LLaMA inference: lanes (micro-batches) issued stage by stage from one thread.

Each lane has its own static KV cache on every stage's device. One thread issues every lane-step in
pipeline order on per-stage CUDA streams, ordered by events, and never waits for a GPU: while stage 1 runs
lane k's step, stage 0 runs lane k+1's, and the last stage's token goes straight back to stage 0 for the
lane's next step. Decode steps, and prefills of a batch shape seen before, are replayed CUDA graphs.
A runner is the stages and streams both halves share (`lanes.LaneStreams`) with its prefill (`lane_prefill.py`) and
its decode steps (`lane_decode.py`, which prefill through the first).
"""

from __future__ import annotations

from .lane_decode import LaneDecode
from .lane_prefill import LanePrefill
from .lanes import EOS_CHECK_LAG, Lane, LaneStreams, OnTokens, graphs_possible, place_lanes, split_lanes
from .causal_lm import CausalLMStages

__all__ = ["EOS_CHECK_LAG", "Lane", "LaneRunner", "OnTokens", "graphs_possible", "place_lanes", "split_lanes"]


class LaneRunner(LaneStreams):
    """One generate() or forward() call, or one continuous batch: every lane-step issued from this thread, stages on
    their own streams; `prefill` runs prompts through the stages, `decode` the decode steps."""

    def __init__(self, stages: CausalLMStages, lanes: list[Lane], graphs: bool, compile: bool = False,
                 dynamic: bool = False) -> None:
        super().__init__(stages, lanes, graphs, compile, dynamic)
        self.prefill = LanePrefill(self)
        self.decode = LaneDecode(self, self.prefill)
