"""The engine of pipelined LLaMA inference: lanes (micro-batches) issued stage by stage from one thread.

Each lane has its own static KV cache on every stage's device. One thread issues every lane-step in
pipeline order on per-stage CUDA streams, ordered by events, and never waits for a GPU: while stage 1 runs
lane k's step, stage 0 runs lane k+1's, and the last stage's token goes straight back to stage 0 for the
lane's next step. Decode steps, and prefills of a batch shape seen before, are replayed CUDA graphs.
The prefill half lives in `lane_prefill.py`, the decode half in `lane_decode.py`, what they share in `lanes.py`.
"""

from __future__ import annotations

from .lane_decode import LaneDecode
from .lane_prefill import LanePrefill
from .lanes import EOS_CHECK_LAG, Lane, OnTokens, graphs_possible, place_lanes, record_event, split_lanes

__all__ = ["EOS_CHECK_LAG", "Lane", "LaneRunner", "OnTokens", "graphs_possible", "place_lanes", "record_event",
           "split_lanes"]


class LaneRunner(LanePrefill, LaneDecode):
    """One generate() or forward() call: every lane-step issued from this thread, stages on their own streams."""
