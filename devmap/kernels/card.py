"""What the kernels' launch rules read of the GPU they run on: how many SMs it has and how much shared memory one
block may take. The rules were timed on H100s and H200s (132 SMs, 227 KiB a block); what they derive from the card
(programs a product aims at, when a product is cut along its inner dimension, how deep a ring of stages may be)
follows each card's own counts, so another card is neither starved of programs nor given a ring it cannot hold."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

RESERVED_SHARED = 7 * 1024  # shared memory left to a kernel's own needs beside its ring (227 - 220 KiB on Hopper)


class Card(NamedTuple):
    """A GPU as the launch rules see it: `sms` streaming multiprocessors, `shared` bytes of shared memory one block
    may take (the opt-in maximum)."""

    sms: int
    shared: int

    @property
    def programs(self) -> int:
        """Programs a product aims at: two per SM (each SM overlaps one program's reads with the other's products)."""
        return 2 * self.sms

    @property
    def spread(self) -> int:
        """Programs from which a product is not cut along its inner dimension: ~3/4 of the SMs (96 of 132)."""
        return self.sms * 8 // 11

    @property
    def ring_bytes(self) -> int:
        """Shared memory a ring of pipeline stages may take (220 KiB of an H100's or H200's 227)."""
        return self.shared - RESERVED_SHARED


HOPPER = Card(sms=132, shared=227 * 1024)  # the H100 and H200 the rules were timed on; also the CPU's stand-in


@functools.lru_cache(maxsize=None)
def card(device: torch.device) -> Card:
    """The card of `device` (a CUDA device), read once per device; `HOPPER` for anything else (the CPU, where
    Triton's interpreter runs the kernels in tests)."""
    if device.type != "cuda":
        return HOPPER
    properties = torch.cuda.get_device_properties(device)
    return Card(properties.multi_processor_count,
                int(getattr(properties, "shared_memory_per_block_optin", 0) or HOPPER.shared))
