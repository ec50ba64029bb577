"""The attention mask of a whole prompt (causal, and left padding where there is any), as transformers builds it for
sdpa and eager attention, made on the device without reading anything on the host.

transformers' own mask code (`devmap.compat.transformers_causal_mask`) is used for other attention implementations;
`tests/generation/test_masks.py` checks that both give the same mask for sdpa and eager.
"""

from __future__ import annotations

import torch


def prompt_mask(padding: torch.Tensor | None, rows: int, length: int, device: torch.device,
                float_dtype: torch.dtype | None) -> torch.Tensor | None:
    """(rows, 1, length, length): token q attends to token k when k <= q and k is not padding.

    `padding` is the prompt's 2-D attention mask (1 for attended tokens), None when no row is padded. Booleans for
    sdpa (`float_dtype` None; with no padding None, so that sdpa takes its causal fast path), additive floats
    (0 or the dtype's lowest value) for eager attention."""
    if padding is None and float_dtype is None:
        return None
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if padding is not None:
        keep = keep & padding.to(device=device, dtype=torch.bool)[:, None, None, :]
    keep = keep.expand(rows, 1, length, length)
    if float_dtype is None:
        return keep
    return torch.where(keep, torch.zeros((), dtype=float_dtype, device=device), torch.finfo(float_dtype).min)
