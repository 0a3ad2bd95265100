"""What the attention ops derive from lengths / a key mask (issue 24): gemcompile::length_order and
gemcompile::key_bounds (lowering/length_order.py), the helpers and counter of common/length_order.py, and the
ops' checks of given derived tensors (q_order, kv_order, kv_bounds). CPU, torch only."""

import pytest
import torch

import gemcompile.lowering  # noqa: F401  registers the ops
from gemcompile.lowering.common import length_order as lo
from gemcompile.lowering.length_order import derive_plan

ops = torch.ops.gemcompile
MASK = torch.tensor([[0, 1, 1, 0, 1, 0], [0] * 6, [1] * 6, [1, 1, 0, 0, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_length_order_is_a_stable_descending_argsort(dtype):
    key = torch.randint(0, 4, (37,), generator=torch.Generator().manual_seed(0)).to(dtype)  # many ties
    lo.reset_counts()
    got = ops.length_order(key)
    assert got.dtype == torch.int64 and torch.equal(got, torch.sort(key, descending=True, stable=True).indices)
    assert lo.COUNTS["order"] == 1
    assert ops.length_order(torch.zeros(0, dtype=dtype)).numel() == 0
    with pytest.raises(ValueError, match="1-D int32/int64"):
        ops.length_order(torch.ones(3))


def test_key_bounds_values_and_order():
    lo.reset_counts()
    bounds, order = ops.key_bounds(MASK, None)
    assert bounds.dtype == torch.int32 and bounds.is_contiguous()
    assert bounds.tolist() == [[1, 5, 1], [6, 0, 0], [0, 6, 0], [0, 6, 1]]  # [lo, hi, holes]; none: [L, 0)
    assert order.tolist() == [2, 3, 0, 1]  # span 4, 0, 6, 6: longest first, ties by index
    assert dict(lo.COUNTS) == {"bounds": 1, "order": 1}
    bounds, _ = ops.key_bounds(MASK, torch.tensor([4, 6, -1, 3]))
    assert bounds.tolist() == [[1, 3, 0], [6, 0, 0], [6, 0, 0], [0, 2, 0]]
    bounds, _ = ops.key_bounds(MASK[:1].expand(3, 6), torch.tensor([99, 2, 5]))  # batch stride 0
    assert bounds.tolist() == [[1, 5, 1], [1, 2, 0], [1, 5, 1]]


def test_opcheck():
    for op, args in ((ops.length_order.default, (torch.tensor([3, 0, 5, 5]),)),
                     (ops.key_bounds.default, (MASK, torch.tensor([4, 6, 2, 3]))),
                     (ops.key_bounds.default, (MASK, None))):
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_derive_plan():
    ql, kl = torch.tensor([3, 1, 2]), torch.tensor([1, 3, 3])
    q_order, kv_order, bounds = derive_plan(ql, kl, None)
    assert q_order.tolist() == [0, 2, 1] and kv_order.tolist() == [1, 2, 0] and bounds is None
    lo.reset_counts()
    q_order, kv_order, _ = derive_plan(kl, kl, None)  # one lengths tensor for both sides: one order
    assert q_order is kv_order and lo.COUNTS["order"] == 1
    _, kv_order, bounds = derive_plan(None, None, MASK[:3])
    assert torch.equal(bounds, lo.key_bounds(MASK[:3], None)) and kv_order.tolist() == [2, 0, 1]
    given = torch.tensor([0, 1, 2])
    assert derive_plan(None, kl, None, kv_order=given)[1] is given


def _jagged(kv_lengths=None, **plan):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1, 6, 16, generator=g) for _ in range(3))
    return ops.jagged_attention(q, k, v, None, kv_lengths, None, False, 0.25, **plan)


def test_ops_refuse_wrong_derived_tensors_on_cpu():
    kl = torch.tensor([2, 6, 0, 3])
    right = torch.sort(kl, descending=True, stable=True).indices
    torch.testing.assert_close(_jagged(kl, kv_order=right), _jagged(kl), rtol=0, atol=0)
    with pytest.raises(ValueError, match="kv_order is not the longest-first order"):
        _jagged(kl, kv_order=right.flip(0))
    with pytest.raises(ValueError, match="nothing to order by"):
        _jagged(None, kv_order=right)
    with pytest.raises(ValueError, match="kv_order must be torch.int64"):
        _jagged(kl, kv_order=right.to(torch.int32))
    with pytest.raises(ValueError, match="kv_bounds is given without a kv_mask"):
        _jagged(kl, kv_bounds=torch.zeros(4, 3, dtype=torch.int32))
    bounds = lo.key_bounds(MASK, kl)
    with pytest.raises(ValueError, match="kv_bounds are not the key bounds"):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(4, 1, 6, 16, generator=g) for _ in range(3))
        ops.gdpa(q, k, v, None, kl, None, "silu", 0.25, 1.0, False, False, 0, kv_mask=MASK,
                 kv_bounds=bounds.flip(0).contiguous())


def test_fake_tensors_pass_the_metadata_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        key = torch.empty(5, dtype=torch.int64)
        assert ops.length_order(key).shape == (5,)
        bounds, order = ops.key_bounds(torch.empty(5, 7, dtype=torch.bool), key)
        assert bounds.shape == (5, 3) and bounds.dtype == torch.int32 and order.dtype == torch.int64
