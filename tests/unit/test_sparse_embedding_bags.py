"""gemcompile::sparse_embedding_bags (lowering/sparse_embedding/bags.py): many tables' bags pooled in one
call. The op on the CPU and the Triton kernel under the interpreter against each table's own
F.embedding_bag (sum and mean, padding ids, bags of padding only, strided ids, no bags); the backward's
filed rows against sparse_embedding's per table; an id outside its table is an error, never a row."""

import os

import pytest
import torch
import torch.nn.functional as F

from gemcompile.lowering.sparse_embedding.bags import bag_row_grads, sparse_embedding_bags
from gemcompile.lowering.sparse_embedding.op import MODE_MEAN, MODE_SUM, per_id_grads
from gemcompile.lowering.sparse_embedding.pending import clear, take_rows

interpreter = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter test: a machine without CUDA (conftest sets TRITON_INTERPRET=1)")


def _tables(rows, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, dim, generator=g).to(dtype) for r in rows]


def _ids(tables_rows, bags, hot, padding_idx, seed=1):
    """(tables, bags, hot) ids, strided (a slice of a (bags, tables, hot) batch, as models index features),
    with padding ids, one bag of padding only and repeated ids."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.stack([torch.randint(0, r, (bags, hot), generator=g) for r in tables_rows], dim=1)
    if padding_idx >= 0 and bags:
        batch[:, :, -1] = padding_idx
        batch[0, 0, :] = padding_idx
    return batch.transpose(0, 1)  # not contiguous


def _want(ids, weights, mode, padding_idx):
    bag_mode = "mean" if mode == MODE_MEAN else "sum"
    padding = padding_idx if padding_idx >= 0 else None
    return torch.stack([F.embedding_bag(ids[t], w, mode=bag_mode, padding_idx=padding) for t, w in enumerate(weights)])


CASES = [((50, 7, 300), 16, 5, 4, MODE_SUM, 0), ((50, 7), 6, 9, 3, MODE_MEAN, 0), ((20,), 33, 4, 1, MODE_SUM, -1),
         ((11, 12, 13, 14), 8, 0, 5, MODE_SUM, 0), ((30, 30), 40, 6, 2, MODE_MEAN, -1)]


@pytest.mark.parametrize("rows,dim,bags,hot,mode,padding_idx", CASES)
def test_op_matches_each_tables_embedding_bag(rows, dim, bags, hot, mode, padding_idx):
    weights = _tables(rows, dim, torch.float32)
    ids = _ids(rows, bags, hot, padding_idx)
    token = torch.zeros(1, dtype=torch.int64)
    got = sparse_embedding_bags(ids, weights, token, mode, padding_idx, list(range(len(rows))))
    assert torch.equal(got, _want(ids, weights, mode, padding_idx))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,dim,bags,hot,mode,padding_idx", CASES)
def test_kernel_matches_each_tables_embedding_bag(rows, dim, bags, hot, mode, padding_idx, dtype):
    from gemcompile.lowering.sparse_embedding.bags_triton import embedding_bags_triton

    weights = _tables(rows, dim, dtype)
    ids = _ids(rows, bags, hot, padding_idx)
    got = embedding_bags_triton(ids, weights, mode == MODE_MEAN, padding_idx)
    want = _want(ids, [w.float() for w in weights], mode, padding_idx)  # fp32 sums, as the kernel keeps them
    assert got.dtype == dtype and got.shape == (len(rows), bags, dim)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=0 if dtype == torch.float32 else 1e-3)


@interpreter
@pytest.mark.parametrize("padding_idx", [0, -1])
@pytest.mark.parametrize("bad", [7, -3, -1, 1 << 40])
def test_kernel_refuses_an_id_outside_its_table(bad, padding_idx):
    """-1 too where the tables have no padding id (passed as -1): it was skipped as padding."""
    from gemcompile.lowering.sparse_embedding.bags_triton import embedding_bags_triton

    weights = _tables((7, 100), 4, torch.float32)
    ids = _ids((7, 7), 3, 2, 0).clamp(min=1)
    ids[0, 2, 1] = bad  # table 0 has 7 rows; 7 is in table 1's range, not in table 0's
    for mean in (False, True):
        with pytest.raises(RuntimeError, match="outside its table's rows"):
            embedding_bags_triton(ids, weights, mean, padding_idx)


def test_op_refuses_mixed_tables_and_bad_shapes():
    token = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="one dim, dtype"):
        sparse_embedding_bags(torch.zeros(2, 3, 1, dtype=torch.int64), [torch.zeros(4, 3), torch.zeros(4, 5)], token,
                              MODE_SUM, None, [1, 2])
    with pytest.raises(ValueError, match=r"\(tables, bags, hot\)"):
        sparse_embedding_bags(torch.zeros(3, 1, dtype=torch.int64), [torch.zeros(4, 3)], token, MODE_SUM, None, [1])
    with pytest.raises(ValueError, match="mode must be sum"):
        sparse_embedding_bags(torch.zeros(1, 3, 1, dtype=torch.int64), [torch.zeros(4, 3)], token, 0, None, [1])


@pytest.mark.parametrize("mode,padding_idx", [(MODE_SUM, 0), (MODE_MEAN, 0), (MODE_MEAN, -1), (MODE_SUM, -1)])
def test_backward_files_what_each_tables_lookup_files(mode, padding_idx):
    rows = (30, 9, 12)
    weights = [w.requires_grad_() for w in _tables(rows, 5, torch.float32)]
    ids = _ids(rows, 6, 4, padding_idx)
    keys = [901, 902, 903]
    token = torch.zeros(1, dtype=torch.int64)
    for key in keys:
        clear(key)
    out = sparse_embedding_bags(ids, weights, token, mode, padding_idx, keys)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert all(w.grad is None for w in weights) and token.item() == 1
    flat, per_id = bag_row_grads(grad, ids, mode, padding_idx)
    for t, key in enumerate(keys):
        (entry,) = take_rows(key)
        filed_ids, filed_rows = entry
        want_ids, want_rows = per_id_grads(grad[t], ids[t], None, mode, padding_idx)
        assert torch.equal(filed_ids, want_ids) and torch.equal(filed_rows, want_rows)
        # its share of the one filing: the optimizer joins consecutive shares without testing addresses
        all_ids, all_rows, index = entry.share
        assert index == t and torch.equal(all_ids[t], filed_ids) and all_rows[t].data_ptr() == filed_rows.data_ptr()
        assert torch.equal(flat[t], want_ids) and torch.equal(per_id[t], want_rows)
    assert filed_rows.data_ptr() != grad.data_ptr()  # fresh rows, never the gradient buffer itself
