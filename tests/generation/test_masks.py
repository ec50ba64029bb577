"""devmap's prompt masks equal transformers' own for sdpa and eager attention (with and without left padding)."""

import pytest
import torch

from devmap.compat import transformers_causal_mask
from devmap.generation.causal_lm import positions
from devmap.generation.masks import prompt_mask


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_masks_equal_transformers(tiny_llama, implementation, padded, dtype):
    config = tiny_llama(attn_implementation=implementation).config
    rows, length = 3, 7
    padding = torch.ones(rows, length, dtype=torch.long)
    if padded:
        padding[0, :4] = 0
        padding[2, :1] = 0
    like = torch.empty(rows, length, 0, dtype=dtype)
    mask = padding if padded else None
    ids = positions(padding, length)
    theirs = transformers_causal_mask(config, like, mask, ids if padded else None)
    ours = prompt_mask(mask, rows, length, like.device, dtype if implementation == "eager" else None)
    if theirs is None:
        assert ours is None
        return
    assert ours is not None and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs.expand_as(ours))
