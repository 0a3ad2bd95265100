"""The benchmarks' FlexAttention peers build their BlockMasks directly (create_block_mask would evaluate
mask_mod on every pair of a GPU-sized problem). Here, on tiny CPU problems, the direct masks equal what
create_block_mask builds from the same mask_mod: the same pairs, the same full blocks (where FlexAttention
skips mask_mod), so the peer is set up as its documentation recommends."""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import block_attention
        import jagged_attention

        yield block_attention, jagged_attention
    finally:
        sys.path.remove(str(BENCH))


def _same(direct, ref):
    assert torch.equal(direct.to_dense(), ref.to_dense())
    assert torch.equal(direct.kv_num_blocks, ref.kv_num_blocks)
    assert ref.full_kv_num_blocks is not None and direct.full_kv_num_blocks is not None
    assert torch.equal(direct.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_block_attention_peer_mask_is_create_block_masks(bench):
    block_attention, _ = bench
    block = block_attention.BLOCK
    L = 3 * block + 8  # a last block the sequence end cuts
    lengths = torch.tensor([0, 1, block - 1, block, block + 1, 2 * block + 2, 3 * block, L])

    def mask_mod(b, h, q, kv):
        return (q // block == kv // block) & (kv < lengths[b])

    direct = block_attention.flex_block_mask(lengths, L)
    assert direct.BLOCK_SIZE == (block, block)
    _same(direct, create_block_mask(mask_mod, len(lengths), None, L, L, device="cpu", BLOCK_SIZE=block))
    # the earlier set-up: blocks twice the mask's, every one partial (mask_mod evaluated on all its pairs)
    wide = block_attention.flex_block_mask(lengths, L, flex_block=2 * block)
    assert wide.full_kv_num_blocks is None
    assert wide.kv_num_blocks.squeeze(1).tolist() == [[int(s < n) for s in (0, 2 * block)] for n in lengths.tolist()]


def test_jagged_attention_peer_mask_is_create_block_masks(bench):
    _, jagged_attention = bench
    lengths = torch.tensor([3, 130, 1, 256, 70])
    direct, TP = jagged_attention.document_block_mask(lengths, block=128)
    T = int(lengths.sum())
    doc = torch.full((TP,), -1)
    doc[:T] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (doc[q] >= 0)

    _same(direct, create_block_mask(mask_mod, 1, None, TP, TP, device="cpu", BLOCK_SIZE=128))


def test_peers_record_their_setup(bench):
    block_attention, jagged_attention = bench
    assert "BLOCK_SIZE 64" in block_attention.PEER_SETUP["flex_no_rotary"]
    # the 64-token set-up lets FlexAttention autotune its tiles (a hand tile left its backward no config)
    assert block_attention.FLEX_MODE.startswith("max-autotune")
    assert block_attention.FLEX_MODE in block_attention.PEER_SETUP["flex_no_rotary"]
    for text in (jagged_attention.PEER_SETUP["compiled_padded"], jagged_attention.PEER_SETUP["flex_document_mask"],
                 block_attention.PEER_SETUP["flex_no_rotary"]):
        assert "dynamic=False" in text and "per shape" in text


def test_jagged_attention_plain_module_is_rewritten_with_its_rows_folded(bench):
    # gem_compile_module measures what a user gets: the pass must fire on it and fold the zeroed query rows
    # into the kernel's q_lengths (else the benchmark would time something other than the claim)
    from gemcompile import GemConfig, explain

    _, jagged_attention = bench
    q, k, v = (torch.randn(3, 2, 64, 32) for _ in range(3))
    lengths = torch.tensor([0, 64, 17])
    report = explain(jagged_attention.plain_padded_module, q, k, v, lengths, config=GemConfig())
    assert report.counts["jagged_attention"] == 1 and not report.refusals
    assert "query rows: n < " in str(report)
    assert set(jagged_attention.PEER_SETUP) == set(jagged_attention.METHODS)
