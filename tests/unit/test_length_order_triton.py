"""The attention kernels' batch order (lowering/common/length_order_triton.py) under the Triton interpreter: a
stable descending argsort of the lengths, against torch.sort."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common.length_order_triton import longest_first_order


@pytest.mark.parametrize("B", [1, 2, 15, 16, 17, 50])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_stable_descending_argsort(B, dtype):
    key = torch.randint(0, 5, (B,), generator=torch.Generator().manual_seed(B)).to(dtype)  # many ties
    got = longest_first_order(key)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.sort(key, descending=True, stable=True).indices)


def test_empty_and_bad_keys():
    assert longest_first_order(torch.zeros(0, dtype=torch.int64)).numel() == 0
    assert torch.equal(longest_first_order(torch.tensor([0, 0, 7, 0])), torch.tensor([2, 0, 1, 3]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        longest_first_order(torch.ones(3))


def _given_and_derived(run, q_lengths, kv_lengths, kv_mask):
    """run(**plan) with the plan derived by the caller (the launchers must derive nothing) and without one;
    both results, bitwise equal."""
    from gemcompile.lowering.common import length_order as lo
    from gemcompile.lowering.length_order import derive_plan

    plan = dict(zip(("q_order", "kv_order", "kv_bounds"), derive_plan(q_lengths, kv_lengths, kv_mask)))
    lo.reset_counts()
    given = run(**plan)
    assert dict(lo.COUNTS) == {}
    derived = run()
    for a, b in zip(given, derived):
        assert torch.equal(a, b)


def test_gdpa_launchers_take_given_orders():
    """Distinct q and kv lengths and a full bias whose gradient is reduced in-kernel: its prefix search walks
    the batches by the given q_order."""
    from gemcompile.lowering.gdpa.spec import GdpaSpec
    from gemcompile.lowering.gdpa.triton import gdpa_backward_triton, gdpa_forward_triton

    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(3, 1, 16, 16, generator=g) for _ in range(4))
    bias = torch.randn(1, 1, 16, 16, generator=g)
    ql, kl = torch.tensor([16, 3, 9]), torch.tensor([5, 16, 0])
    spec = GdpaSpec("silu", 0.25)

    def run(**plan):
        out = gdpa_forward_triton(q, k, v, ql, kl, bias, spec, **plan)
        return (out, *gdpa_backward_triton(grad, q, k, v, ql, kl, bias, spec, None, True, **plan))

    _given_and_derived(run, ql, kl, None)


def test_jagged_launchers_take_given_orders_and_bounds():
    from gemcompile.lowering.jagged_attention.triton import (
        jagged_attention_backward_triton,
        jagged_attention_forward_triton,
    )

    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(3, 1, 16, 16, generator=g) for _ in range(4))
    ql, kl = torch.tensor([16, 3, 9]), torch.tensor([12, 16, 7])
    mask = torch.rand(3, 16, generator=g) > 0.3

    def run(**plan):
        out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, None, True, 0.25, mask, **plan)
        return (out, *jagged_attention_backward_triton(grad, q, k, v, out, lse, ql, kl, None, True, 0.25, False,
                                                       mask, **plan)[:3])

    _given_and_derived(run, ql, kl, mask)


def test_block_launchers_take_given_bounds():
    from gemcompile.lowering.block_attention.triton import (
        block_attention_backward_triton,
        block_attention_forward_triton,
    )

    g = torch.Generator().manual_seed(2)
    q, k, v, grad = (torch.randn(3, 1, 16, 16, generator=g) for _ in range(4))
    lengths = torch.tensor([16, 11, 0])
    mask = torch.rand(3, 16, generator=g) > 0.3

    def run(**plan):
        out, lse = block_attention_forward_triton(q, k, v, lengths, 8, -1, False, None, None, "none", 0.25, mask,
                                                  kv_bounds=plan.get("kv_bounds"))
        return (out, *block_attention_backward_triton(grad, q, k, v, out, lse, lengths, 8, -1, False, None, None,
                                                      "none", 0.25, mask, kv_bounds=plan.get("kv_bounds")))

    _given_and_derived(run, None, lengths, mask)


def _masks():
    g = torch.Generator().manual_seed(3)
    B, L = 7, 37
    random = torch.rand(B, L, generator=g) > 0.5
    random[0] = False  # no valid key
    random[1] = True  # every key
    random[2] = False
    random[2, 36] = True  # only the last
    pos = torch.arange(L)
    lengths = torch.randint(-2, L + 5, (B,), generator=g)  # out of range too: clamped like the torch path
    left = pos[None, :] >= L - lengths.clamp(0, L)[:, None]
    return [("random", random, None), ("random_lengths", random, lengths), ("left", left, None),
            ("expanded", random[3:4].expand(B, L), None), ("strided", torch.rand(B, 2 * L, generator=g)[:, ::2] > 0.3,
                                                            lengths.to(torch.int32)),
            ("long", torch.rand(3, 1000, generator=g) > 0.99, None), ("no_keys", torch.zeros(2, 0, dtype=torch.bool), None)]


@pytest.mark.parametrize("case", _masks(), ids=lambda c: c[0])
def test_key_bounds_kernel_matches_torch(case):
    from gemcompile.lowering.common.length_order import key_bounds, key_span
    from gemcompile.lowering.common.length_order_triton import key_bounds_and_span

    _, mask, lengths = case
    bounds, span = key_bounds_and_span(mask, lengths)
    if mask.shape[1] == 0:  # no key at all: lo = L = 0, hi = 0, no holes
        assert bounds.tolist() == [[0, 0, 0]] * mask.shape[0] and span.tolist() == [0] * mask.shape[0]
        return
    want = key_bounds(mask, lengths)
    assert bounds.dtype == torch.int32 and torch.equal(bounds, want)
    assert torch.equal(span, key_span(want))


def test_key_bounds_kernel_empty_batch_and_bad_mask():
    from gemcompile.lowering.common.length_order_triton import key_bounds_and_span

    bounds, span = key_bounds_and_span(torch.zeros(0, 5, dtype=torch.bool), None)
    assert bounds.shape == (0, 3) and span.shape == (0,)
    with pytest.raises(ValueError, match="2-D bool"):
        key_bounds_and_span(torch.zeros(2, 5), None)


@pytest.mark.parametrize("B", [5, 50, 130])
def test_rank_kernel_with_narrower_column_blocks(B):
    """The launcher uses BLOCK 16 under the interpreter; on CUDA, BLOCK up to 128 against BLOCK_J = 32
    columns at a time: that split, run here directly."""
    import triton

    from gemcompile.lowering.common.length_order_triton import _rank_kernel

    key = torch.randint(0, 7, (B,), generator=torch.Generator().manual_seed(B))  # many ties
    order = torch.full((B,), -1, dtype=torch.int64)
    _rank_kernel[(triton.cdiv(B, 64),)](key, order, B, BLOCK=64, BLOCK_J=32)
    assert torch.equal(order, torch.sort(key, descending=True, stable=True).indices)
