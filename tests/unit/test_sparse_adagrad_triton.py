"""The row-wise Adagrad kernel (lowering/sparse_embedding/adagrad_triton.py) under the Triton interpreter,
against the plain-PyTorch reference: repeated ids, padding ids (-1), ids past the table (skipped, never
written), empty input, dims that are not a power of two."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_rows_triton_
from gemcompile.lowering.sparse_embedding.reference import adagrad_rows_reference_


@pytest.mark.parametrize("rows,dim,n,grad_dtype,deterministic", [
    (40, 6, 30, torch.float32, False), (9, 33, 50, torch.float16, True), (200, 64, 120, torch.float32, True),
    (3, 16, 90, torch.float32, False), (5, 1, 0, torch.float32, False)])
def test_matches_reference(rows, dim, n, grad_dtype, deterministic):
    g = torch.Generator().manual_seed(rows * dim + n)
    weight = torch.randn(rows, dim, generator=g)
    state = torch.rand(rows, dim, generator=g)
    ids = (torch.rand(n, generator=g) ** 2 * rows).long()  # skewed: many repeats
    ids[::7] = -1  # padding
    grads = torch.randn(n, dim, generator=g).to(grad_dtype)
    want_w, want_s = weight.double(), state.double()  # float64: the kernels sum a row's repeats in another order
    adagrad_rows_reference_(want_w, want_s, ids, grads.double(), 0.05, 1e-10)
    adagrad_rows_triton_(weight, state, ids, grads, 0.05, 1e-10, deterministic=deterministic)
    torch.testing.assert_close(state, want_s.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight, want_w.float(), rtol=1e-5, atol=1e-6)
    if n:
        assert not torch.equal(weight, torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows * dim + n)))


@pytest.mark.parametrize("deterministic", [False, True])
def test_ids_past_the_table_are_skipped(deterministic):
    weight, state = torch.zeros(4, 3), torch.zeros(4, 3)
    ids = torch.tensor([1, 4, 99, 1, -1])
    adagrad_rows_triton_(weight, state, ids, torch.ones(5, 3), 0.1, 1e-10, deterministic=deterministic)
    assert torch.equal(state[1], torch.full((3,), 4.0))  # row 1 twice: g = 2, sum = 4
    assert torch.count_nonzero(state) == 3 and torch.count_nonzero(weight) == 3


@pytest.mark.parametrize("rows,dim,dtype", [((40, 3, 200), 6, torch.float32), ((9, 9), 33, torch.float16),
                                            ((5,), 16, torch.float32), ((7, 1, 12, 2), 1, torch.float32)])
def test_many_tables_in_one_go_match_the_reference_per_table(rows, dim, dtype):
    """adagrad_tables_triton_: one sort and one launch for all tables, each table's rows updated as the
    reference updates it alone; padding and out-of-range ids skipped; an empty table's list left alone."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    g = torch.Generator().manual_seed(sum(rows) * dim)
    weights = [torch.randn(r, dim, generator=g).to(dtype) for r in rows]
    sums = [torch.rand(r, dim, generator=g) for r in rows]
    ids, grads = [], []
    for t, r in enumerate(rows):
        n = 0 if t == 1 else 3 * r + 5
        i = (torch.rand(n, generator=g) ** 2 * (r + 3)).long() - 1  # repeats, -1 padding, some past the table
        ids.append(i)
        grads.append(torch.randn(n, dim, generator=g))
    want = [(w.clone().float(), s.clone()) for w, s in zip(weights, sums)]
    for (w, s), i, gr in zip(want, ids, grads):
        keep = i < w.shape[0]  # the reference skips only negative ids
        adagrad_rows_reference_(w, s, i[keep], gr[keep], 0.05, 1e-10)
    adagrad_tables_triton_(weights, sums, ids, grads, 0.05, 1e-10)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for (w_want, s_want), w, s in zip(want, weights, sums):
        torch.testing.assert_close(s, s_want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.float(), w_want.to(dtype).float(), rtol=tol, atol=tol)


def test_many_tables_filed_as_views_of_one_buffer_match_the_reference():
    """The bag tables file their ids and rows as consecutive slices of one fresh pair (bags.py): the update
    reads that buffer in place (no concatenation) and still equals the reference per table."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    g = torch.Generator().manual_seed(3)
    tables, n, rows, dim = 4, 37, 11, 5
    weights = [torch.randn(rows, dim, generator=g) for _ in range(tables)]
    sums = [torch.rand(rows, dim, generator=g) for _ in range(tables)]
    flat = (torch.rand(tables, n, generator=g) * (rows + 1)).long() - 1
    grad_rows = torch.randn(tables, n, dim, generator=g)
    want = [(w.clone(), s.clone()) for w, s in zip(weights, sums)]
    for t, (w, s) in enumerate(want):
        keep = flat[t] < rows
        adagrad_rows_reference_(w, s, flat[t][keep], grad_rows[t][keep], 0.05, 1e-10)
    adagrad_tables_triton_(weights, sums, list(flat), list(grad_rows), 0.05, 1e-10)
    for (w_want, s_want), w, s in zip(want, weights, sums):
        torch.testing.assert_close(s, s_want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w, w_want, rtol=1e-6, atol=1e-6)


def test_many_tables_with_several_lookups_each_read_in_place_match_the_reference():
    """A table looked up several times a step (the item table of each sequence) files one part per lookup:
    the update takes the parts as they are, with another table's and an empty part between them."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    g = torch.Generator().manual_seed(5)
    rows, dim = (30, 7), 6
    weights = [torch.randn(r, dim, generator=g) for r in rows]
    sums = [torch.rand(r, dim, generator=g) for r in rows]
    ids = [[(torch.rand(n, generator=g) * (r + 2)).long() - 1 for n in (40, 0, 25)] for r in rows]
    grads = [[torch.randn(i.numel(), dim, generator=g) for i in parts] for parts in ids]
    want = [(w.clone(), s.clone()) for w, s in zip(weights, sums)]
    for (w, s), i, gr in zip(want, ids, grads):
        i, gr = torch.cat(i), torch.cat(gr)
        keep = i < w.shape[0]
        adagrad_rows_reference_(w, s, i[keep], gr[keep], 0.05, 1e-10)
    adagrad_tables_triton_(weights, sums, ids, grads, 0.05, 1e-10)
    for (w_want, s_want), w, s in zip(want, weights, sums):
        torch.testing.assert_close(s, s_want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w, w_want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", ["filed", "shuffled"])
def test_many_tables_given_their_shares_of_one_filing_match_the_reference(order):
    """The batched bag backward files each table's slice with its share of the whole filing (pending.Filed):
    consecutive shares are read as one part without an address test; out of the filing's order (tables
    listed otherwise, another table's lookup between them) each share is its own part. Either way the update
    equals the reference per table."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    g = torch.Generator().manual_seed(11)
    tables, n, rows, dim = 5, 23, 13, 4
    flat = (torch.rand(tables, n, generator=g) * (rows + 2)).long() - 1
    grad_rows = torch.randn(tables, n, dim, generator=g)
    extra_ids = (torch.rand(9, generator=g) * rows).long()  # table 2 is also looked up on its own
    extra_rows = torch.randn(9, dim, generator=g)
    weights = [torch.randn(rows, dim, generator=g) for _ in range(tables)]
    sums = [torch.rand(rows, dim, generator=g) for _ in range(tables)]
    want = [(w.clone(), s.clone()) for w, s in zip(weights, sums)]
    for t, (w, s) in enumerate(want):
        i, gr = flat[t], grad_rows[t]
        if t == 2:
            i, gr = torch.cat([i, extra_ids]), torch.cat([gr, extra_rows])
        keep = i < rows
        adagrad_rows_reference_(w, s, i[keep], gr[keep], 0.05, 1e-10)
    visit = list(range(tables)) if order == "filed" else [3, 0, 4, 2, 1]
    ids = [[flat[t]] + ([extra_ids] if t == 2 else []) for t in visit]
    grads = [[grad_rows[t]] + ([extra_rows] if t == 2 else []) for t in visit]
    shares = [[(flat, grad_rows, t)] + ([None] if t == 2 else []) for t in visit]
    adagrad_tables_triton_([weights[t] for t in visit], [sums[t] for t in visit], ids, grads, 0.05, 1e-10,
                           shares)
    for (w_want, s_want), w, s in zip(want, weights, sums):
        torch.testing.assert_close(s, s_want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w, w_want, rtol=1e-6, atol=1e-6)


def test_runs_join_only_consecutive_shares_of_one_filing():
    from gemcompile.lowering.sparse_embedding.adagrad_triton import TableSet, _runs

    ids, rows = torch.arange(12).reshape(4, 3), torch.randn(4, 3, 2)
    other_ids, other_rows = ids.clone(), rows.clone()
    order = [(ids, rows, 0), (ids, rows, 1), (ids, rows, 2), (ids, rows, 0), None,
             (other_ids, other_rows, 3), (ids, rows, 3)]
    parts = [(k % 2, s[0][s[2]], s[1][s[2]], s) if s else (0, torch.tensor([7]), torch.zeros(1, 2), None)
             for k, s in enumerate(order)]
    tables = TableSet([torch.zeros(20, 2), torch.zeros(20, 2)], [torch.zeros(20, 2), torch.zeros(20, 2)])
    id_runs, grad_runs, counts, table_of_part = _runs(tables, parts)
    assert [r.numel() for r in id_runs] == [9, 3, 1, 3, 3]  # 0-2 joined; a restart, None, another filing
    assert id_runs[0].data_ptr() == ids.data_ptr() and grad_runs[0].data_ptr() == rows.data_ptr()
    assert torch.equal(torch.cat(id_runs), torch.cat([p[1] for p in parts]))
    assert torch.equal(torch.cat(grad_runs), torch.cat([p[2] for p in parts]))
    assert counts == [3, 3, 3, 3, 1, 3, 3] and table_of_part == [0, 1, 0, 1, 0, 1, 0]


def test_runs_check_each_filing_once_and_every_other_part():
    """A filing whose rows do not match its ids, or a lone part with the wrong dim: a clear error."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import TableSet, _runs

    tables = TableSet([torch.zeros(5, 2)], [torch.zeros(5, 2)])
    ids, rows = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 2)  # 3 ids per table, 4 rows
    with pytest.raises(ValueError, match="ids must be"):
        _runs(tables, [(0, ids[0], rows[0], (ids, rows, 0))])
    with pytest.raises(ValueError, match="grads"):
        _runs(tables, [(0, torch.zeros(3, dtype=torch.long), torch.zeros(3, 3), None)])
    with pytest.raises(TypeError, match="integer"):
        _runs(tables, [(0, torch.zeros(3), torch.zeros(3, 2), None)])


def test_a_table_set_refuses_tables_the_launch_cannot_serve():
    from gemcompile.lowering.sparse_embedding.adagrad_triton import TableSet

    with pytest.raises(ValueError, match="float32 sums"):
        TableSet([torch.zeros(4, 2)], [torch.zeros(4, 2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="unit"):
        TableSet([torch.zeros(2, 4).t()], [torch.zeros(4, 2)])
    with pytest.raises(ValueError, match="one .rows, dim. shape"):
        TableSet([torch.zeros(4, 2)], [torch.zeros(4, 3)])


def test_joined_reads_adjacent_slices_in_place_and_copies_anything_else():
    from gemcompile.lowering.sparse_embedding.adagrad_triton import _joined

    base = torch.arange(24.0).reshape(4, 3, 2)
    parts = list(base)
    whole = _joined(parts)
    assert whole.data_ptr() == base.data_ptr() and torch.equal(whole, torch.cat(parts))
    one_row = list(base[:, :1])  # (1, 2) slices 6 elements apart: not adjacent
    assert torch.equal(_joined(one_row), torch.cat(one_row)) and _joined(one_row).data_ptr() != base.data_ptr()
    rows = list(base.reshape(12, 2).split([1, 5, 6]))  # adjacent, one of them a single row
    assert _joined(rows).data_ptr() == base.data_ptr() and torch.equal(_joined(rows), base.reshape(12, 2))
    swapped = [parts[1], parts[0]]
    assert torch.equal(_joined(swapped), torch.cat(swapped))
    other = [parts[0], parts[1].clone()]  # another buffer
    assert torch.equal(_joined(other), torch.cat(other))


def test_many_tables_refuse_mixed_dims():
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    with pytest.raises(ValueError, match="one dim"):
        adagrad_tables_triton_([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2, 3), torch.zeros(2, 4)],
                               [torch.tensor([0]), torch.tensor([1])], [torch.ones(1, 3), torch.ones(1, 4)], 0.1, 1e-10)


def test_many_distinct_ids_past_the_table_are_skipped_without_overflowing_the_slots():
    """More distinct out-of-range ids than the table has rows: every one is skipped (before, each took a slot
    of the min(ids, rows + 1) the update allocates, and the slot index ran past them)."""
    weight, state = torch.zeros(2, 3), torch.zeros(2, 3)
    ids = torch.tensor([0, 5, 6, 7, 8, -3, -4, 1])
    adagrad_rows_triton_(weight, state, ids, torch.ones(8, 3), 0.1, 1e-10, deterministic=False)
    assert torch.equal(state, torch.ones(2, 3))


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("n,rows,dim", [(1000, 3, 5), (257, 40, 16), (33, 1, 1), (600, 600, 7)])
def test_slot_sums_match_float64_with_runs_across_blocks(n, rows, dim, parts):
    """Step 2 alone: the segmented sums per slot, runs of one id longer than a block (16 positions under
    the interpreter) split across programs and added back together (atomically for a block's first and last
    slots, stored for the others), against float64 sums. With parts, the gradient rows lie in separate
    tensors (one with a row stride wider than its rows), read in place in their concatenated order."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import _sum_by_id

    g = torch.Generator().manual_seed(n + rows)
    ids = (torch.rand(n, generator=g) ** 3 * rows).long()
    grads = torch.randn(n, dim, generator=g)
    sorted_ids, perm = torch.sort(ids, stable=True)
    cuts = [0, n // 3, n // 2, n][: parts] + [n] if parts > 1 else [0, n]
    pieces = [grads[a:b] for a, b in zip(cuts, cuts[1:])]
    if parts > 1:  # the first part as a column slice of a wider buffer: row stride dim + 3
        wide = torch.zeros(pieces[0].shape[0], dim + 3)
        wide[:, :dim] = pieces[0]
        pieces[0] = wide[:, :dim]
    id_of, acc, last_slot = _sum_by_id(sorted_ids, perm, pieces, rows)
    distinct = torch.unique(ids)
    assert last_slot.tolist() == [distinct.numel() - 1]
    assert torch.equal(id_of[: distinct.numel()], distinct) and bool((id_of[distinct.numel():] == -1).all())
    want = torch.zeros(rows, dim, dtype=torch.float64).index_add_(0, ids, grads.double())
    torch.testing.assert_close(acc[: distinct.numel()].double(), want[distinct], rtol=1e-5, atol=1e-5)
    assert not acc[distinct.numel():].any()
