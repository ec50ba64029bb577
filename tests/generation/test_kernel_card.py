"""The kernels' launch rules read the card they run on (`devmap.kernels.card`): on an H100 or H200 (and on the CPU,
where Triton's interpreter stands in) the counts they were timed with; on a card with fewer SMs or less shared
memory, fewer programs per product, shares of the inner dimension where programs would be few, and rings that fit."""

import pytest
import torch

from devmap.kernels import four_bit_products, int8_products
from devmap.kernels.card import HOPPER, Card, card

SMALL = Card(sms=58, shared=99 * 1024)  # an L4-sized card (sm_89: 58 SMs, 99 KiB a block)


def test_the_cpu_and_hopper_give_the_counts_the_rules_were_timed_with():
    assert card(torch.device("cpu")) is HOPPER
    assert (HOPPER.programs, HOPPER.spread, HOPPER.ring_bytes) == (264, 96, 220 * 1024)


def test_int8_decode_blocks_widen_where_the_card_has_fewer_programs():
    assert int8_products.block_shape(1, 15360).out == 64  # qkv of a 13B layer: 240 programs of 64 columns fit 264
    assert int8_products.block_shape(1, 15360, SMALL).out == 128  # 116 programs: blocks of 128 columns
    assert int8_products.block_shape(1, 5120, SMALL) == int8_products.block_shape(1, 5120)  # narrow: split anyway


def test_four_bit_shares_follow_the_cards_programs():
    assert four_bit_products.block_shape(1, 5120, 40).splits == 6  # 264 // 80 blocks, twice up to 16 rows
    assert four_bit_products.block_shape(1, 5120, 40, SMALL).splits == 2  # 116 // 80
    assert four_bit_products.block_shape(32, 5120, 40, SMALL).splits == 2  # 116 // 40 blocks of 128 columns


def test_hoppers_shares_follow_the_cards_sms():
    pytest.importorskip("triton.experimental.gluon")
    from devmap.kernels.four_bit_products_wgmma import wgmma_shape

    pcie = Card(sms=114, shared=227 * 1024)  # an H100 PCIe: Hopper, fewer SMs
    assert wgmma_shape(64, 5120, 40, 128).splits == 3  # 80 blocks of 64 columns, fewer than 96: 264 // 80 shares
    assert wgmma_shape(64, 5120, 40, 128, gpu=pcie).splits == 2  # 228 // 80
    assert wgmma_shape(64, 15360, 40, 128, gpu=pcie).splits == 1  # 240 blocks: programs enough
