"""Loading: checkpoints on disk onto the devices a plan chose, and new checkpoints written.

Owns safetensors headers and their checks (names stay inside the model directory), the parallel reads
into pinned buffers and copies to each device, quantization block by block, dispatch with accelerate's hooks,
disk offload, random initialization and `devmap save` (shards, an atomically installed directory). Imports
`devmap.planning` and `devmap.errors`, never the stages above.
"""
