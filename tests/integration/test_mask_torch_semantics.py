"""Mask and score spellings whose meaning rests on torch's rules rather than on their positional operands:
keyword arguments (``arange(start=1, end=L + 1)``, ``torch.lt(input=, other=)``, ``add(alpha=)``,
``div(rounding_mode=)``), bool arithmetic (``True + True`` is True), Python floats rounded to the tensor's
dtype (``0.1f > 0.1`` is False), diagonals and slices of data masks. Each must equal eager; the ones that are
provably a lengths / causal mask are rewritten, the others refused."""

import pytest
import torch

from gemcompile import explain, gem_compile

B, H, L, D = 3, 1, 8, 16
LENGTHS = torch.tensor([8, 3, 5])


def _positions():
    return torch.arange(L)[None, :, None], torch.arange(L)[None, None, :]


# name -> (keep mask of (i, j, n (B, 1, 1), data (B, L + 2) int)) -> (B, L, L) or broadcastable, rewritten?)
MASKS = {
    # arange's named bounds: j + 1 <= n is j < n; 2 j < n is not j < n
    "arange_start_end_named": (lambda i, j, n, d: (torch.arange(start=1, end=L + 1) <= n) & (j <= i), True),
    "arange_step_named": (lambda i, j, n, d: (torch.arange(0, 2 * L, step=2) < n) & (j <= i), None),
    # named operands of the comparison, the sum, the transpose, the where
    "lt_named": (lambda i, j, n, d: torch.lt(input=j, other=n) & (j <= i), True),
    "add_other_named": (lambda i, j, n, d: (torch.add(j, other=1) <= n) & (j <= i), True),
    "transpose_named": (lambda i, j, n, d: torch.transpose((j <= i) & (j < n), dim0=1, dim1=2).transpose(1, 2),
                        True),
    "where_named": (lambda i, j, n, d: torch.where(condition=j < n, input=j <= i, other=False), True),
    "compare_with_true": (lambda i, j, n, d: (j < True) | ((j <= i) & (j < n)), True),
    # alpha scales the second operand: j - 2 n < 0 is j < 2 n
    "sub_alpha": (lambda i, j, n, d: (torch.sub(j, n, alpha=2) < 0) & (j <= i), None),
    # bool + bool is or: (padded causal) + causal == 1 is causal (an xor would be the lengths mask)
    "bool_sum_is_or": (lambda i, j, n, d: (((j >= n) & (j <= i)) + (j <= i)) == 1, True),
    # 0.1 rounds to the fp32 weight 0.1f: w > 0.1 keeps the valid keys only
    "float_compare_rounds": (lambda i, j, n, d: (torch.where(j < n, 1.0, 0.1) > 0.1) & (j <= i), True),
    # 1.0f * 3.3f - 3.3f is exactly 0 on the valid keys: valid or causal, not a lengths mask
    "float_arith_rounds": (lambda i, j, n, d: (((j < n).float() * 3.3 - 3.3) == 0) | (j <= i), False),
    # floor(1.5) is 1: valid or causal
    "float_div_floor": (lambda i, j, n, d: (torch.div((j < n).float() * 3, 2, rounding_mode="floor") == 1)
                        | (j <= i), False),
    # an int64 mask compared with a float is compared in float32: 2**24 + 1 is 2**24 there
    "int_mask_vs_float": (lambda i, j, n, d: (torch.where(j < n, 0, 16777217) != 16777216.0) & (j <= i), True),
    # x.where(c, y) is where(c, x, y): where the key is valid, causal; else not kept
    "method_where": (lambda i, j, n, d: (j <= i).where(j < n, j < n), True),
    # squeeze drops a size-1 dim (CANINE's molecule mask), nothing else
    "squeezed": (lambda i, j, n, d: (j < n).float()[..., None].squeeze(-1).bool() & (j <= i), True),
    # a data mask sliced to the key count (HF's attention_mask[:, :key_len]), and its diagonal-like misreads
    "data_mask_sliced": (lambda i, j, n, d: d[:, :L].bool()[:, None, :] & (j <= i), True),
    "data_mask_chunk_at_an_offset": (lambda i, j, n, d: d[:, 2:].bool()[:, None, :] & (j <= i), True),  # CANINE
    # masked_fill's value as a 0-dim tensor (RecBole's DIN: value=torch.tensor(mask_value)): the constant
    "masked_fill_tensor_value": (lambda i, j, n, d: torch.ones(B, L, L).masked_fill(
        (j >= n) | (j > i), torch.tensor(0.0)) > 0, True),
    # ... and one read from data: the padded keys are kept where d[0, 3] is 1, so no lengths mask
    "masked_fill_data_value": (lambda i, j, n, d: (torch.ones(B, L, L).masked_fill(
        j >= n, d[0, 3].float()) > 0) & (j <= i), False),
}


def _masked(mask):
    def f(q, k, v, n, data):
        i, j = _positions()
        keep = mask(i, j, n[:, None, None], data)
        s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(~keep[:, None], float("-inf"))
        return torch.softmax(s, -1) @ v
    return f


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    data = (torch.rand(B, L + 2) > 0.3).long()
    data[:, :3] = 1  # every row keeps its first key
    return q, k, v, LENGTHS, data


def _check_equal(f, inputs):
    torch._dynamo.reset()
    ref = f(*inputs)
    out = gem_compile(f)(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), inputs[:3]), torch.autograd.grad(ref.sum(), inputs[:3])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_spelling_means_what_torch_computes(name):
    mask, rewritten = MASKS[name]
    f = _masked(mask)
    inputs = _inputs()
    _check_equal(f, inputs)
    if rewritten is not None:
        assert explain(f, *inputs).counts.get("jagged_attention", 0) == int(rewritten)


# scores read with alpha= or rounding_mode=: not the sum or the scale they look like
def _scores_alpha(q, k, v, n, data):
    i, j = _positions()
    add = torch.zeros(B, L, L).masked_fill(~((j <= i) & (j < n[:, None, None])), -1e4)[:, None]
    return torch.softmax(torch.add(q @ k.transpose(-2, -1) * 0.3, add, alpha=-1), -1) @ v


def _scores_floor_div(q, k, v, n, data):
    i, j = _positions()
    s = torch.div(q @ k.transpose(-2, -1), 0.25, rounding_mode="floor")
    return torch.softmax(s.masked_fill(~((j <= i) & (j < n[:, None, None]))[:, None], float("-inf")), -1) @ v


def _scores_where_named(q, k, v, n, data):
    i, j = _positions()
    keep = ((j <= i) & (j < n[:, None, None]))[:, None]
    return torch.softmax(torch.where(condition=keep, input=q @ k.transpose(-2, -1), other=float("-inf")), -1) @ v


def _scores_bmm_named(q, k, v, n, data):  # torch names bmm's second operand mat2
    i, j = _positions()
    b, h, length, d = q.shape
    s = torch.bmm(q.reshape(b * h, length, d), mat2=k.reshape(b * h, length, d).transpose(1, 2))
    keep = ((j <= i) & (j < n[:, None, None]))[:, None]
    return torch.softmax(s.view(b, h, length, length).masked_fill(~keep, float("-inf")), -1) @ v


@pytest.mark.parametrize("f, rewritten", [(_scores_alpha, False), (_scores_floor_div, False),
                                          (_scores_where_named, True), (_scores_bmm_named, True)],
                         ids=["scores_alpha", "scores_floor_div", "scores_where_named", "scores_bmm_named"])
def test_score_spelling_means_what_torch_computes(f, rewritten):
    inputs = _inputs()
    _check_equal(f, inputs)
    if rewritten is not None:
        assert explain(f, *inputs).counts.get("jagged_attention", 0) == int(rewritten)


def test_a_key_mask_read_on_a_tables_diagonal_is_not_the_table():
    # cm[j, j] for every sample: with as many samples as keys, building it as cm[b, j] went unnoticed
    torch.manual_seed(0)

    def f(q, k, v, cm):
        ar = torch.arange(L)
        s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(~cm[ar, ar][None, None, None, :], float("-inf"))
        return torch.softmax(s, -1) @ v

    q, k, v = (torch.randn(L, H, L, D) for _ in range(3))
    cm = torch.rand(L, L) > 0.5
    cm.fill_diagonal_(True)
    torch._dynamo.reset()
    torch.testing.assert_close(gem_compile(f)(q, k, v, cm), f(q, k, v, cm), atol=1e-5, rtol=1e-5)


def test_where_with_named_branches_keeps_its_per_head_values():
    # a per-head value named as where's input= was read as no operand: head 0's key mask served head 1 too
    torch.manual_seed(0)
    heads = 2

    def f(q, k, v, ids):
        a = ids[:, None, None, :] - 5 * torch.arange(heads)[None, :, None, None]  # (B, H, 1, L)
        keep = torch.sign(torch.where((ids > 0)[:, None, None, :], input=a, other=0)) > 0
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), -1) @ v

    q, k, v = (torch.randn(2, heads, L, D, requires_grad=True) for _ in range(3))
    ids = torch.tensor([[3, 7, 9, 1, 6, 0, 0, 0], [8, 2, 6, 7, 0, 0, 0, 0]])
    torch._dynamo.reset()
    torch.testing.assert_close(gem_compile(f)(q, k, v, ids), f(q, k, v, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, size", [(torch.int8, 130), (torch.bfloat16, 260)])
def test_arange_in_a_dtype_that_wraps_or_rounds_is_not_read_as_positions(dtype, size):
    from gemcompile.passes.graph import Unproven
    from gemcompile.passes.masks.arange import arange_value
    from torch import fx

    graph = fx.Graph()
    node = graph.call_function(torch.arange, (size,), {"dtype": dtype})
    node.meta["example_value"] = torch.arange(size, dtype=dtype)
    evaluate = lambda x: x  # noqa: E731  (the bounds are Python numbers here)
    with pytest.raises(Unproven, match="wraps or rounds"):
        arange_value(evaluate, node)
    exact = graph.call_function(torch.arange, (100,), {"dtype": dtype})
    exact.meta["example_value"] = torch.arange(100, dtype=dtype)
    assert arange_value(evaluate, exact).expr is not None


def test_a_key_mask_sliced_from_a_longer_one_under_dynamic_shapes():
    """attention_mask[:, :N] with N dynamic: the key vector narrows to the key count (it was refused)."""
    from torch._dynamo.utils import counters

    def f(q, k, v, am):
        keep = am[:, :q.shape[2]][:, None, None, :]
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf")), -1) @ v

    torch._dynamo.reset()
    counters.clear()
    compiled = gem_compile(f)  # static first, then the sizes that changed (N, the mask's width) dynamic
    for n, wide in ((8, 10), (10, 13), (6, 11)):
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        am = torch.rand(B, wide, generator=torch.Generator().manual_seed(n)) > 0.3
        am[:, 0] = True
        torch.testing.assert_close(compiled(q, k, v, am), f(q, k, v, am), atol=1e-5, rtol=1e-5)
    assert counters["gemcompile"]["jagged_attention"] == 2 and not counters["gemcompile"]["jagged_attention_refused"]
