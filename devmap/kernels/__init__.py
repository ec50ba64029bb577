"""Kernels: the GPU code devmap writes itself, where measurement says it beats the libraries that do the same job
(docs/kernels.md keeps that table and the command behind it).

Decode attention over a lane's live cache columns (`decode_attention`), matrix products with int8 weights carrying a
scale per output row (`int8_products`), and with 4-bit weights in devmap's plain layout (`four_bit_layout`,
`four_bit_products`; Hopper's asynchronous tensor-core kernel in `four_bit_products_wgmma`; the Linear modules that
hold such weights in `four_bit_linear`), and with float8 weights and tokens carrying a scale per row at decode rows
(`fp8_products`; `torch._scaled_mm` past them). The product families answer one protocol (`quantized_products`:
when a kernel applies, the product, preparing the kernels; split-K written once in `split_k`) and fall back to torch
or the library where no kernel applies; each `*_kernel` module holds Triton code, imported only where it runs. The
launch rules read the card they run on (`card`: its SMs and shared memory), not the H100/H200 they were timed on.
Imports `devmap.compat` only: generation and serving call these, never the other way.
"""
