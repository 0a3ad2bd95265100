"""Tensors a proof reads, written in place after they were built: directly, through a view, through a cast
that returns its input (``.long()`` of int64, ``.bool()`` of bool, ``.to(same)``), ``.data``, ``out=``, a
helper function. Each gave a silent wrong answer before the alias classes of masks/mutation.py (the mask
read as the ops built it while the kernel read the changed tensor at run time, or the change dropped: up to
4.7 off). Now every one is compiled == eager for outputs and q/k gradients: refused, or rewritten where the
proof reads only tensors that are never changed (the mask itself, built before the change, read as data)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rewritten import rewritten

B, H, L, D = 4, 2, 12, 16
LENGTHS = torch.tensor([12, 3, 0, 7])


def _positions():
    return torch.arange(L)


def _sdpa(q, k, m):
    m = m[:, None, None, :] if m.dim() == 2 and m.shape[0] == B else (m[:, None] if m.dim() == 3 else m)
    return F.scaled_dot_product_attention(q, k, k, attn_mask=m)


def _keys(lengths):
    return _positions()[None, :] < lengths[:, None]


def _set_last_key(m):
    m[:, -1] = True


CASES = {
    # the lengths or ids a mask was built from, changed afterwards (the kernel would read them changed)
    "lengths_clamp_after": lambda q, k, n, ids: (v := _keys(n), n.clamp_(max=3), _sdpa(q, k, v))[-1],
    "lengths_isub_after": lambda q, k, n, ids: (v := _keys(n), n.__isub__(2), _sdpa(q, k, v))[-1],
    "lengths_long_alias_clamp": lambda q, k, n, ids: (v := _keys(n), n.long().clamp_(max=3), _sdpa(q, k, v))[-1],
    "lengths_data_clamp": lambda q, k, n, ids: (v := _keys(n), n.data.clamp_(max=3), _sdpa(q, k, v))[-1],
    "lengths_out_kw": lambda q, k, n, ids: (v := _keys(n), torch.clamp(n, max=3, out=n), _sdpa(q, k, v))[-1],
    "ids_long_alias_fill": lambda q, k, n, ids: (m := ids != 0, ids.long().masked_fill_(ids > 40, 0),
                                                 _sdpa(q, k, m))[-1],
    "lengths_einsum_view_clamp": lambda q, k, n, ids: (v := _keys(n), torch.einsum("b->b", n).clamp_(max=3),
                                                       _sdpa(q, k, v))[-1],  # one operand: a view
    # the mask itself changed through an alias (the change was dropped)
    "mask_einsum_view_setitem": lambda q, k, n, ids: (m := _keys(n), torch.einsum("bl->lb", m).__setitem__(-1, True),
                                                      _sdpa(q, k, m))[-1],
    "mask_bool_alias_setitem": lambda q, k, n, ids: (m := _keys(n), m.bool().__setitem__((slice(None), -1), True),
                                                     _sdpa(q, k, m))[-1],
    "mask_data_setitem": lambda q, k, n, ids: (m := _keys(n), m.data.__setitem__((slice(None), -1), True),
                                               _sdpa(q, k, m))[-1],
    "mask_out_kw": lambda q, k, n, ids: (m := _keys(n), torch.logical_or(m, _positions()[None, :] == L - 1, out=m),
                                         _sdpa(q, k, m))[-1],
    "mask_ravel_setitem": lambda q, k, n, ids: (m := _keys(n), m.ravel().__setitem__(2 * L + 5, True),
                                                _sdpa(q, k, m))[-1],
    "mask_helper_function": lambda q, k, n, ids: (m := _keys(n), _set_last_key(m), _sdpa(q, k, m))[-1],
    "repeat_bool_alias_tril": lambda q, k, n, ids: (m := _keys(n)[:, None, :].repeat(1, L, 1), m.bool().tril_(),
                                                    _sdpa(q, k, m))[-1],
    "repeat_swapaxes_triu": lambda q, k, n, ids: (m := _keys(n)[:, None, :].repeat(1, L, 1),
                                                  m.swapaxes(1, 2).triu_(), _sdpa(q, k, m))[-1],
    "causal_data_setitem": lambda q, k, n, ids: (c := torch.ones(L, L, dtype=torch.bool).tril(),
                                                 c.data.__setitem__((0, 1), True), _sdpa(q, k, c & _keys(n)[:, None, :]))[-1],
    # the query-row mask the output is zeroed by, changed through an alias
    "row_mask_bool_alias": lambda q, k, n, ids: (v := _keys(n), o := _sdpa(q, k, v),
                                                 v.bool().__setitem__((slice(None), -1), True),
                                                 o * v[:, None, :, None])[-1],
}


def _inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    ids = torch.randint(1, 50, (B, L), generator=g) * _keys(torch.tensor([12, 5, 2, 9]))
    return q, k, ids


@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_changed_in_place_never_gives_another_answer(name):
    fn = CASES[name]
    q, k, ids = _inputs()
    out = rewritten(fn)(q, k, LENGTHS.clone(), ids.clone())
    ref = fn(q, k, LENGTHS.clone(), ids.clone())
    defined = torch.isfinite(ref)  # a row with no valid key: NaN in eager (-inf fill), 0 in the kernel
    torch.testing.assert_close(torch.where(defined, out, 0), torch.where(defined, ref, 0), atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((torch.where(defined, out, 0) * weights).sum(), (q, k))
    grads_ref = torch.autograd.grad((torch.where(defined, ref, 0) * weights).sum(), (q, k))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want), atol=5e-5, rtol=1e-4)


def test_two_inputs_viewing_one_tensor_are_one_tensor():
    """``fn(q, k, n, n.view(-1))``: Dynamo gives the two views two graph inputs over one storage; a write
    through the second after the mask was built from the first must be seen (the kernel read the lengths
    clamped at run time: 2.07 off)."""
    def fn(q, k, n, n_view):
        valid = _keys(n)
        n_view.clamp_(max=3)
        return _sdpa(q, k, valid)

    q, k, _ = _inputs()
    n_out, n_ref = LENGTHS.clone(), LENGTHS.clone()
    out, ref = rewritten(fn)(q, k, n_out, n_out.view(-1)), fn(q, k, n_ref, n_ref.view(-1))
    defined = torch.isfinite(ref)
    torch.testing.assert_close(torch.where(defined, out, 0), torch.where(defined, ref, 0), atol=2e-5, rtol=1e-4)
    assert torch.equal(n_out, n_ref)


class _FfnZeroedTwice(torch.nn.Module):
    """A token-wise FFN between two zeroings by the padding vector, which changes between them through
    ``.data``: unpad would pack both ends by the vector rebuilt from the ids (param gradients 1.5 off)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(H * D, 4 * H * D), torch.nn.Linear(4 * H * D, H * D)

    def forward(self, x, ids):
        pad = ids == 0
        x = x * ~pad[..., None]
        pad.data[:, -1] = False  # the last token is kept from here on
        return self.down(F.gelu(self.up(x))) * ~pad[..., None]


def test_a_row_vector_changed_through_data_is_not_packed_by():
    torch.manual_seed(0)
    model = _FfnZeroedTwice()
    _, _, ids = _inputs()
    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out, ref = rewritten(model)(x, ids.clone()), model(x, ids.clone())
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    leaves = [x, *model.parameters()]
    for got, want in zip(torch.autograd.grad((out * weights).sum(), leaves),
                         torch.autograd.grad((ref * weights).sum(), leaves)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


class _DropoutThenZeroed(torch.nn.Module):
    """pmixer / RecTools SASRec: ``seqs = dropout(seqs); seqs *= timeline_mask``: the in-place product writes
    seqs only; the mask it reads is not updated (unpad refused it as updated in place)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(H * D, 4 * H * D), torch.nn.Linear(4 * H * D, H * D)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x, ids):
        timeline = (ids != 0).unsqueeze(-1)
        x = self.drop(x * 2.0)
        x *= timeline
        x = self.down(F.gelu(self.up(x)))
        x *= timeline
        return x


def test_the_multiplier_of_an_in_place_product_is_not_updated():
    from gemcompile import explain

    torch.manual_seed(0)
    model = _DropoutThenZeroed()
    _, _, ids = _inputs()
    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(5), requires_grad=True)
    assert explain(model, x, ids).counts.get("unpad", 0) == 1
    out, ref = rewritten(model)(x, ids.clone()), model(x, ids.clone())
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    leaves = [x, *model.parameters()]
    for got, want in zip(torch.autograd.grad(out.square().sum(), leaves),
                         torch.autograd.grad(ref.square().sum(), leaves)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


class _ScoresBufferCastLike(torch.nn.Module):
    """MEANTIME: the scores written into a zeros buffer cast like q (``torch.zeros(B, h, T, T).to(q)`` or
    ``.type_as(q)``), then added to in place. The buffer is a copy of zeros, never q: the projections and the
    FFN are not updated in place (unpad refused them "through an alias")."""

    def __init__(self, cast):
        super().__init__()
        self.cast = cast
        self.q, self.k, self.v = (torch.nn.Linear(H * D, H * D) for _ in range(3))
        self.up, self.down = torch.nn.Linear(H * D, 2 * H * D), torch.nn.Linear(2 * H * D, H * D)

    def forward(self, x, ids):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, H, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = self.cast(torch.zeros(b, H, n, n), q)
        scores += q @ k.transpose(-1, -2)
        scores = scores.masked_fill((ids == 0)[:, None, None, :], -1e9)
        h = x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)
        return (h + self.down(F.gelu(self.up(h)))) * (ids != 0)[..., None]


@pytest.mark.parametrize("cast", [lambda t, q: t.to(q), lambda t, q: t.type_as(q)], ids=["to", "type_as"])
def test_a_buffer_cast_like_another_tensor_is_no_alias_of_it(cast):
    from gemcompile import explain

    torch.manual_seed(0)
    model = _ScoresBufferCastLike(cast)
    _, _, ids = _inputs()
    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(5), requires_grad=True)
    reasons = [r.reason for r in explain(model, x, ids).refusals if r.pass_name == "unpad"]
    assert not any("through an alias" in r for r in reasons), reasons
    out, ref = rewritten(model)(x, ids.clone()), model(x, ids.clone())
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
