"""Planning: where each block of a model goes, computed on the meta device without touching a GPU.

Owns model sources (presets, local directories, modules), the sanity limits on their configs and the rule that file
names in a checkpoint's metadata stay inside its directory, memory units and budgets (real, simulated or explicit),
the device key (`devices`), the placement strategies built on accelerate's `infer_auto_device_map`, device-map specs
and their checks, quantized sizes, tensor-parallel splits (what one GPU of a group holds), the memory a workload
needs beside the weights (measured on the meta device), per-device reports and per-layer tables. `hardware` is the
one module that asks torch.cuda about the machine. Imports `devmap.compat` (a decoder layer's call),
`devmap.releases` and `devmap.errors`; everything else imports it.
"""
