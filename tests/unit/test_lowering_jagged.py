"""lowering/common/jagged.py: offsets, padded <-> jagged round trips, length bucketing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemcompile.lowering.common.jagged import (
    bucket_length,
    jagged_to_padded,
    lengths_to_offsets,
    offsets_to_lengths,
    padded_to_jagged,
)


def test_lengths_to_offsets_values():
    offsets = lengths_to_offsets(torch.tensor([3, 0, 2, 5]))
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == [0, 3, 3, 5, 10]
    assert offsets_to_lengths(offsets).tolist() == [3, 0, 2, 5]


def test_lengths_to_offsets_empty_batch():
    assert lengths_to_offsets(torch.zeros(0, dtype=torch.int64)).tolist() == [0]


def test_padded_to_jagged_hand_case():
    padded = torch.tensor([[1, 2, 0], [0, 0, 0], [7, 8, 9]])
    values, offsets = padded_to_jagged(padded, torch.tensor([2, 0, 3]))
    assert values.tolist() == [1, 2, 7, 8, 9]
    assert offsets.tolist() == [0, 2, 2, 5]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    max_len=st.integers(6, 8),
    feature=st.integers(1, 3),
)
def test_round_trip(lengths, max_len, feature):
    lengths_t = torch.tensor(lengths)
    padded = torch.randn(len(lengths), max_len, feature)
    padded[torch.arange(max_len)[None, :] >= lengths_t[:, None]] = 0.0
    values, offsets = padded_to_jagged(padded, lengths_t)
    assert values.shape == (sum(lengths), feature)
    for b, n in enumerate(lengths):
        assert torch.equal(values[offsets[b] : offsets[b + 1]], padded[b, :n])
    assert torch.equal(jagged_to_padded(values, offsets, max_len), padded)


def test_jagged_to_padded_padding_value_and_dtype():
    out = jagged_to_padded(torch.tensor([1.5, 2.5, 3.5]), torch.tensor([0, 1, 3]), 3, padding_value=-1)
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.5, -1, -1], [2.5, 3.5, -1]]


@pytest.mark.parametrize("lengths", [[4, 1], [-1, 2]])
def test_padded_to_jagged_rejects_bad_lengths(lengths):
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 3\]"):
        padded_to_jagged(torch.zeros(2, 3), torch.tensor(lengths))


def test_jagged_to_padded_rejects_too_long_sample():
    with pytest.raises(ValueError, match="more than max_len = 2"):
        jagged_to_padded(torch.zeros(3), torch.tensor([0, 3]), 2)


def test_jagged_to_padded_rejects_mismatched_offsets():
    with pytest.raises(ValueError, match="end at values.shape"):
        jagged_to_padded(torch.zeros(3), torch.tensor([0, 2]), 4)


@pytest.mark.parametrize("n, expected", [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128), (1000, 1024)])
def test_bucket_length_power_of_two(n, expected):
    assert bucket_length(n) == expected


def test_bucket_length_configured_buckets():
    assert bucket_length(5, buckets=[16, 8, 32]) == 8
    assert bucket_length(8, buckets=(8, 16)) == 8
    assert bucket_length(9, buckets=(8, 16)) == 16
    with pytest.raises(ValueError, match="exceeds the largest bucket 16"):
        bucket_length(17, buckets=(8, 16))


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bucket_length_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        bucket_length(bad)


def test_bucket_length_rejects_bad_buckets():
    with pytest.raises(ValueError, match="buckets must be"):
        bucket_length(3, buckets=[])
    with pytest.raises(ValueError, match="buckets must be"):
        bucket_length(3, buckets=[0, 4])
