"""Loading: checkpoints on disk onto the devices a plan chose, and new checkpoints written.

Owns safetensors headers and their checks (names stay inside the model directory), the parallel reads into pinned
buffers and copies to each device, quantization block by block, dispatch with accelerate's hooks, disk offload, one
process's shard of a tensor-parallel model (its slices of the checkpoint, the layers where the group's partial
results meet), random initialization and `devmap save` (shards, an atomically installed directory). Imports
`devmap.planning` and `devmap.errors`, never the stages above.
"""
