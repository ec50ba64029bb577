"""Loading: checkpoints on disk onto the devices a plan chose, and new checkpoints written.

Owns safetensors headers and their checks (names stay inside the model directory), the parallel reads
into pinned buffers and copies to each device, dispatch with accelerate's hooks, disk offload, random
initialization and `devmap save`. Imports `devmap.planning` and `devmap.errors`, never the stages above.
"""
