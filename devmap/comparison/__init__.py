"""Comparison: the PyTorch model-parallel tutorial's timing experiment, identical, with devmap's pipeline beside it.

Owns the tutorial's models and harness (timeit, split-size sweep), devmap's systems in that harness, and
the tutorial's plots. Imports `devmap.pipelining`, `devmap.loading`, `devmap.planning` and `devmap.errors`;
only `devmap.cli` imports it.
"""
