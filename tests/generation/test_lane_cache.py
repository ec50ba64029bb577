"""A lane's static KV cache: prompts packed in a scratch cache go into their rows' columns, all layers at once where
both caches hold their layers in blocks, exactly as a copy per layer puts them."""

import torch

from devmap.generation.lane_cache import LaneCache


def test_prompts_go_into_their_rows_columns_in_one_copy_as_per_layer_copies_put_them():
    layers, heads, dim = [4, 5, 6], 2, 8
    scratch = LaneCache(1, 32, torch.device("cpu"))
    scratch.allocate(layers, heads, dim, torch.float32)
    for index in layers:
        scratch.keys[index].normal_()
        scratch.values[index].normal_()
    rows, columns = torch.tensor([2, 2, 2, 0, 0]), torch.tensor([14, 15, 0, 7, 8])  # the first prompt wraps around
    fused = LaneCache(3, 16, torch.device("cpu"))
    fused.allocate(layers, heads, dim, torch.float32)
    assert fused.blocks is not None and fused.keys[5].is_contiguous()
    fused.take_prompts(scratch, 3, 8, rows, columns)
    for index in layers:
        for mine, theirs in ((fused.keys[index], scratch.keys[index]), (fused.values[index], scratch.values[index])):
            expected = torch.zeros_like(mine)
            for t in range(5):
                expected[rows[t], :, columns[t]] = theirs[0, :, 3 + t]
            assert torch.equal(mine, expected)
    assert fused.first_rows(2).blocks is None  # a view of some rows writes per layer
