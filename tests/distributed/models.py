"""Model factories for `--factory` in the distributed tests."""

import os

from torch import nn


def small_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 10))


def fails_on_rank_1() -> nn.Module:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 could not build its model")
    return small_sequential()

