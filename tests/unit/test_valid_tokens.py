"""gemcompile::valid_token_index and valid_mask_index: the flat positions of the valid tokens, against a plain
loop."""

import pytest
import torch

from gemcompile.lowering.valid_tokens import valid_mask_index, valid_token_index, valid_token_index_reference


def loop_reference(lengths: list[int], max_len: int) -> list[int]:
    return [b * max_len + n for b, length in enumerate(lengths) for n in range(max_len) if n < length]


@pytest.mark.parametrize("lengths, max_len", [
    ([3, 0, 5], 5),  # zero and full length
    ([0, 0], 4),  # nothing valid
    ([7, 1], 4),  # a length past the padded size keeps every position
    ([-2, 2], 3),  # a negative length keeps none
    ([1], 1),
    ([], 6),  # empty batch
])
def test_valid_token_index_matches_loop(lengths, max_len):
    t = torch.tensor(lengths, dtype=torch.int64)
    index = valid_token_index(t, max_len)
    assert index.dtype == torch.int64
    assert index.tolist() == loop_reference(lengths, max_len)
    assert valid_token_index_reference(t.to(torch.int32), max_len).tolist() == index.tolist()


def test_valid_token_index_order_is_the_jagged_order():
    torch.manual_seed(0)
    lengths = torch.randint(0, 9, (6,))
    x = torch.randn(6, 8, 3)
    index = valid_token_index(lengths, 8)
    packed = x[index // 8, index % 8]
    expected = torch.cat([x[b, : int(n)] for b, n in enumerate(lengths)])
    assert torch.equal(packed, expected)


def test_valid_token_index_rejects_bad_lengths():
    with pytest.raises(ValueError, match="1-D"):
        valid_token_index(torch.zeros(2, 2, dtype=torch.int64), 3)
    with pytest.raises(TypeError, match="integer"):
        valid_token_index(torch.zeros(2), 3)


def test_valid_token_index_opcheck():
    torch.library.opcheck(torch.ops.gemcompile.valid_token_index.default, (torch.tensor([2, 0, 3]), 4),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_valid_token_index_compiles_with_a_dynamic_size():
    """One graph for every token count: the size is an unbacked SymInt, not a recompile."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def pack(x, lengths):
        index = torch.ops.gemcompile.valid_token_index(lengths, x.shape[1])
        return x[index // x.shape[1], index % x.shape[1]] * 2

    x = torch.randn(3, 5, 2)
    for lengths in ([1, 2, 3], [5, 5, 5], [0, 0, 0], [4, 0, 2]):
        t = torch.tensor(lengths)
        out = pack(x, t)
        assert out.shape == (sum(min(n, 5) for n in lengths), 2)
    assert counter.frame_count == 1


def test_valid_token_index_on_meta_sees_every_row():
    """Meta tensors carry no lengths (explain on the meta device): the shape-only answer is B * N rows."""
    index = valid_token_index(torch.empty(3, dtype=torch.int64, device="meta"), 5)
    assert index.shape == (15,) and index.device.type == "meta"


# -- gemcompile::valid_mask_index: the same positions, for tokens marked by a (B, N) bool vector ----------

@pytest.mark.parametrize("valid", [
    [[True, False, True, True], [False, False, False, False], [False, True, True, True]],  # holes, left padding
    [[False] * 3] * 2,  # nothing valid
    [[True] * 5],
])
def test_valid_mask_index_matches_loop(valid):
    t = torch.tensor(valid)
    index = valid_mask_index(t)
    n = t.shape[1]
    assert index.dtype == torch.int64
    assert index.tolist() == [b * n + i for b, row in enumerate(valid) for i, v in enumerate(row) if v]


def test_valid_mask_index_of_a_length_mask_is_valid_token_index():
    lengths = torch.tensor([3, 0, 5, 1])
    assert torch.equal(valid_mask_index(torch.arange(5)[None, :] < lengths[:, None]), valid_token_index(lengths, 5))


def test_valid_mask_index_rejects_bad_vectors_and_passes_opcheck():
    with pytest.raises(ValueError, match="bool"):
        valid_mask_index(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        valid_mask_index(torch.ones(6, dtype=torch.bool))
    torch.library.opcheck(torch.ops.gemcompile.valid_mask_index.default, (torch.tensor([[True, False], [True, True]]),),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_valid_mask_index_compiles_with_a_dynamic_size():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def pack(x, ids):
        index = torch.ops.gemcompile.valid_mask_index(ids != 0)
        return x[index // x.shape[1], index % x.shape[1]] * 2

    x = torch.randn(3, 5, 2)
    for ids in (torch.randint(0, 3, (3, 5)), torch.zeros(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int64)):
        assert pack(x, ids).shape == (int((ids != 0).sum()), 2)
    assert counter.frame_count == 1
