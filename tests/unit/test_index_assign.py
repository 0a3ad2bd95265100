"""``x[index] = value`` on part of a fresh tensor, read as ``where(selected, value, x)``
(passes/attention/index_assign.py through in_place.functionalize_fresh_updates): every served spelling leaves
no setitem in the graph and gives eager's values, at static and dynamic sizes; the near misses (a value
spanning a partial slice, an integer index tensor, a step, a tensor read after the update through a view)
keep their setitem and still give eager's values."""

from __future__ import annotations

import operator

import pytest
import torch

from gemcompile.passes.attention.in_place import functionalize_fresh_updates

B, L = 3, 7


def _ids(lengths=(7, 0, 4)):
    return (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).long() * torch.arange(1, L + 1)


SERVED = {
    "int_column_tensor_value": lambda m, ids: m.__setitem__((slice(None), 0), torch.zeros(m.shape[0], dtype=m.dtype)),
    "negative_int_scalar": lambda m, ids: m.__setitem__((slice(None), -1), False),
    "partial_slice_scalar": lambda m, ids: m.__setitem__((slice(None), slice(2, 5)), True),
    "ellipsis_slice_column_value": lambda m, ids: m.__setitem__((Ellipsis, slice(None, 3)), (ids[:, 0] > 3)[:, None]),
    "bool_rows_and_last_key": lambda m, ids: m.__setitem__((m.all(-1), -1), False),
    "int_row": lambda m, ids: m.__setitem__(1, True),
    "slice_to_minus_one": lambda m, ids: m.__setitem__((slice(None), slice(1, -1)), False),
}
KEPT = {
    "value_spans_partial_slice": lambda m, ids: m.__setitem__((slice(None), slice(1, 4)), (ids > 2)[:, 1:4]),
    "integer_index_tensor": lambda m, ids: m.__setitem__((torch.arange(m.shape[0]), ids.argmax(-1)), True),
    "step": lambda m, ids: m.__setitem__((slice(None), slice(None, None, 2)), True),
}


def _program(update, float_result=False):
    def f(ids):
        m = ids == 0
        update(m, ids)
        out = torch.zeros(m.shape, dtype=torch.float32).masked_fill(m, float("-inf")) if float_result else m
        return out, ids.sum()
    return f


def _compiled(f, dynamic):
    seen = {}

    def backend(gm, example_inputs):
        seen["rewritten"] = functionalize_fresh_updates(gm.graph)
        gm.recompile()
        seen["setitems"] = sum(n.target is operator.setitem for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(f, backend=backend, dynamic=dynamic, fullgraph=True), seen


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("spelling", list(SERVED) + list(KEPT))
def test_an_assignment_to_part_of_a_fresh_mask_equals_eager(spelling, dynamic):
    update = {**SERVED, **KEPT}[spelling]
    f = _program(update, float_result=spelling.startswith("int_column"))
    compiled, seen = _compiled(f, dynamic)
    for lengths in ((7, 0, 4), (0, 0, 0), (7, 7, 7)):
        ids = _ids(lengths)
        out, ref = compiled(ids.clone()), f(ids.clone())
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)
    if spelling in SERVED:
        assert seen["rewritten"] == 1 and seen["setitems"] == 0, seen
    else:
        assert seen["setitems"] == 1, seen


def test_a_view_taken_before_the_assignment_and_read_after_keeps_it_in_place():
    """A view of the mask taken before the update sees the update in eager: the setitem stays."""
    def f(ids):
        m = ids == 0
        first_rows = m[:2]
        m[:, 0] = True
        return first_rows.clone(), m

    compiled, seen = _compiled(f, dynamic=False)
    ids = _ids()
    for o, r in zip(compiled(ids), f(ids)):
        torch.testing.assert_close(o, r)
    assert seen["setitems"] == 1, seen


DYNAMIC_BOUNDS = {  # bounds from a size Dynamo makes dynamic
    "last_c_columns": lambda m, c: m.__setitem__((slice(None), slice(-c, None)), True),
    "all_but_last_c": lambda m, c: m.__setitem__((slice(None), slice(None, -c)), True),
    "column_c_from_the_end": lambda m, c: m.__setitem__((slice(None), -c), True),
    "column_c": lambda m, c: m.__setitem__((slice(None), c), True),
    # c - 3 is negative at c = 2 and not at 4: Dynamo guards on its sign, each graph holds one meaning
    "from_c_minus_3": lambda m, c: m.__setitem__((slice(None), slice(c - 3, None)), True),
}


@pytest.mark.parametrize("spelling", list(DYNAMIC_BOUNDS))
def test_a_bound_from_a_dynamic_size_counts_from_the_end_when_negative(spelling):
    """``m[:, -c:] = v`` with c a dynamic size: -c is negative, so the region is the last c columns (it was
    compared as ``arange >= -c``: every column). (A bound whose sign neither the shapes nor Dynamo's guards
    fix would stay a setitem.)"""
    update = DYNAMIC_BOUNDS[spelling]

    def f(ids, cand):
        m = ids == 0
        update(m, cand.shape[1])
        return m, ids.sum()

    compiled, seen = _compiled(f, dynamic=True)
    for c in (3, 4, 2, 5):
        ids, cand = _ids(), torch.ones(B, c)
        for o, r in zip(compiled(ids.clone(), cand), f(ids.clone(), cand)):
            torch.testing.assert_close(o, r)
    assert seen["rewritten"] == 1 and seen["setitems"] == 0, seen


def test_a_number_outside_the_dtype_is_cast_as_eager_casts_it():
    """``s[..., 0] = -1e9`` on float16 scores: eager's setitem casts the number (-inf); the out-of-place form
    casts it the same way rather than handing it to masked_fill, which refuses a number that overflows."""
    def f(x):
        s = x.half() * 2
        s[:, 0] = -1e9
        return s

    compiled, seen = _compiled(f, dynamic=False)
    x = torch.randn(B, L)
    out, ref = compiled(x), f(x)
    assert torch.equal(out, ref) and torch.isinf(ref[:, 0]).all()
    assert seen["rewritten"] == 1 and seen["setitems"] == 0, seen
