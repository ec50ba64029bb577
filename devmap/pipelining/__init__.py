"""Pipelining: a placed model run as micro-batches whose stages work at the same time, for inference and training.

Owns stages and the units they are cut into (residual blocks split at a boundary), the worker threads and
CUDA streams, CUDA graphs per (stage, micro-batch), the split of backward into input and weight halves,
balancing by time or measured steps, and `tune`. Imports `devmap.planning` and `devmap.errors` (it may import
`devmap.loading`, a floor below it, and does not). `Pipeline` and `pipeline` are re-exported here.
"""

from .factory import pipeline
from .pipe import Pipeline

__all__ = ["Pipeline", "pipeline"]
