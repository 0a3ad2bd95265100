"""``gemcompile::jagged_attention_lse``: the kernel's (out, lse) with lse differentiable (its gradient enters the
backward's delta). Against plain PyTorch in float64 (logsumexp of the masked scores), gradcheck, and the
Triton kernels (interpreter) against the reference with a gradient on lse, padded and packed."""

import os

import pytest
import torch

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.common.packed import pack_padded
from gemcompile.lowering.jagged_attention.packed import packed_reference_backward, packed_reference_forward

ops = torch.ops.gemcompile
INTERPRETER = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(dtype=torch.float64, B=3, H=2, L=9, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.tensor([0, L, 4])[:B]


def _finite(lse):
    return torch.where(torch.isinf(lse), 0.0, lse)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_and_its_gradient_equal_logsumexp_of_the_masked_scores(causal):
    q, k, v, lengths = _inputs()
    L = q.shape[2]
    out, lse = ops.jagged_attention_lse(q, k, v, None, lengths, None, causal, 0.3)
    valid = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        valid = valid & torch.ones(L, L, dtype=torch.bool).tril()
    ref = torch.logsumexp((q @ k.transpose(-1, -2) * 0.3).masked_fill(~valid, float("-inf")), -1)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))  # +inf (ours) where eager gives -inf: no key
    w = torch.randn(lse.shape, dtype=lse.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((_finite(lse) * w).sum(), (q, k))
    want = torch.autograd.grad((_finite(ref) * w).sum(), (q, k))
    torch.testing.assert_close(_finite(lse), _finite(ref))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda q, k, v: tuple(map(_finite, ops.jagged_attention_lse(q, k, v, None, lengths, None, causal, 0.3))),
        (q, k, v), fast_mode=True)  # random directions: the gradients above are already checked against eager's


def test_the_internal_lse_of_jagged_attention_fwd_stays_non_differentiable():
    q, k, v, lengths = _inputs()
    out, lse = ops.jagged_attention_fwd(q, k, v, None, lengths, None, False, 0.3)
    assert not lse.requires_grad and out.requires_grad


@pytest.mark.skipif(not INTERPRETER, reason="Triton interpreter on a machine without CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_triton_backward_with_a_gradient_on_lse_equals_the_reference(packed):
    from gemcompile.lowering.jagged_attention import packed_triton

    q, k, v, lengths = (t.detach() if t.dtype.is_floating_point else t for t in _inputs(torch.float32, L=24))
    kw, q_lengths, kv_lengths = {}, None, lengths
    if packed:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        q, k, v = (pack_padded(t, offsets, int(offsets[-1])) for t in (q, k, v))
        kw, kv_lengths = dict(token_offsets=offsets, packed_len=24), None
    out, lse = packed_triton.jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, None, True, 0.3, **kw)
    ref_out, ref_lse = packed_reference_forward(q.double(), k.double(), v.double(), q_lengths, kv_lengths, None,
                                                True, 0.3, **kw)
    g = torch.Generator().manual_seed(3)
    grad_out, grad_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    got = packed_triton.jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, None,
                                                         True, 0.3, False, None, None, 0.0, None, grad_lse, **kw)
    want = packed_reference_backward(grad_out.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                                     q_lengths, kv_lengths, None, True, 0.3, False, None, None, 0.0, None,
                                     grad_lse.double(), **kw)
    for a, b in zip(got[:3], want[:3]):
        assert ((a.double() - b).norm() / b.norm()).item() < 5e-5


@pytest.mark.parametrize("dropout", [False, True])
def test_opcheck(dropout):
    """torch.library.opcheck (schema, fake impl, autograd registration) of the lse op, and of the fwd op with
    dropout arguments."""
    q, k, v, lengths = _inputs(torch.float32)
    kwargs = dict(dropout_p=0.2, dropout_seed=torch.tensor(5)) if dropout else {}
    for op in (ops.jagged_attention_lse.default, ops.jagged_attention_fwd.default):
        result = torch.library.opcheck(op, (q, k, v, None, lengths, None, False, 0.3), kwargs)
        assert all(v == "SUCCESS" for v in result.values()), result
