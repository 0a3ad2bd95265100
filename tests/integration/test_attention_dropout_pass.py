"""Attention that trains with dropout on its weights, as recommender and transformer code writes it
(``nn.Dropout`` after the softmax, SDPA's ``dropout_p``, ``nn.MultiheadAttention(dropout=...)``, weights of
batch and heads merged), is rewritten into the jagged kernel, which draws the dropout itself.

The compiled model draws one seed per attention from torch's generator; eager drops other numbers. So the
reference is the eager model with its dropout replaced by the kernel's keep mask under those seeds
(F.dropout and SDPA patched for the reference run only): outputs and every gradient must then be equal
(float32). Models that must stay eager keep their reason: two dropouts, a p computed in the graph, a
family whose kernel has no dropout.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain
from gemcompile.lowering.common.dropout import keep_mask, keep_scale
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import Bert4RecAttention, BertStyleSelfAttention, SASRecBlock
from tests.rewritten import rewritten

B, L, H, D = 4, 12, 2, 16
E = H * D
_SDPA = F.scaled_dot_product_attention
_DROPOUT = F.dropout


class MergedHeadsDropout(nn.Module):
    """fairseq style: weights of batch and heads merged (B * H, L, L), dropout, bmm."""

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.qkv, self.p = nn.Linear(E, 3 * E), p

    def forward(self, x, lengths):
        q, k, v = (t.reshape(B, L, H, D).transpose(1, 2).reshape(B * H, L, D) for t in self.qkv(x).chunk(3, -1))
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
        pad = torch.arange(L, device=x.device)[None, :] >= lengths[:, None]
        s = s.view(B, H, L, L).masked_fill(pad[:, None, None, :], float("-inf")).view(B * H, L, L)
        p = F.dropout(F.softmax(s, dim=-1), p=self.p, training=self.training)
        return torch.bmm(p, v).view(B, H, L, D).transpose(1, 2).reshape(B, L, E)


class QueryMaskedDropout(nn.Module):
    """TF SASRec's order: softmax, query masking of the weights' rows, dropout, then @ v."""

    def __init__(self):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(E, 3 * E), nn.Dropout(0.3)

    def forward(self, x, lengths):
        q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        valid = torch.arange(L, device=x.device)[None, :] < lengths[:, None]
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~valid[:, None, None, :], float("-inf"))
        p = s.softmax(-1) * valid[:, None, :, None]
        return (self.dropout(p) @ v).transpose(1, 2).reshape(B, L, E)


def _lengths(kind: str = "lengths"):
    """A full sequence, two partial, and an empty one where eager defines it (a finite fill); elsewhere one
    token (eager's rows of an empty sequence under -inf are NaN, and so are its gradients)."""
    return torch.tensor([L, 0 if kind == "attention_mask" else 1, 5, 9])


def _inputs(kind, g):
    lengths = _lengths(kind)
    valid = torch.arange(L)[None, :] < lengths[:, None]
    hidden = torch.randn(B, L, E, generator=g).requires_grad_()
    if kind == "attention_mask":
        return hidden, valid.long()
    if kind == "ids":  # item ids, 0 = padding, right padded
        return hidden, torch.where(valid, torch.randint(1, 50, (B, L), generator=g), 0)
    return hidden, lengths


MODELS = {  # name: (make, input kind, defined rows: whether eager leaves rows past a length NaN-free)
    "bert_eager_finite_fill": (lambda: BertStyleSelfAttention(H, D, sdpa=False, attention_dropout=0.1),
                               "attention_mask"),
    "bert_sdpa_dropout_p": (lambda: BertStyleSelfAttention(H, D, sdpa=True, attention_dropout=0.1),
                            "attention_mask"),
    "bert4rec": (lambda: Bert4RecAttention(H, D, dropout=0.2), "ids"),
    "sasrec_mha": (lambda: SASRecBlock(H, D, dropout=0.2), "ids"),
    "merged_heads_bmm": (MergedHeadsDropout, "lengths"),
    "query_masked_then_dropout": (QueryMaskedDropout, "lengths"),
}


def _fixed_dropout(seeds: list[torch.Tensor]):
    """(dropout, sdpa) that drop with the kernel's keep masks, one seed per call in call order."""
    calls = iter(seeds)

    def keep(shape, p):
        seed = next(calls)
        if len(shape) == 3:  # (B * H, Lq, Lk): key b * H + h is the merged index n
            return keep_mask(seed, p, shape[0], 1, shape[1], shape[2], "cpu")[:, 0]
        return keep_mask(seed, p, shape[0], shape[1], shape[2], shape[3], "cpu")

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        return x * keep(x.shape, p) * keep_scale(p)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p == 0:
            return _SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        return dropout(s.softmax(-1), dropout_p) @ v

    return dropout, sdpa


def _seeds(generator_seed: int, sites: int) -> list[torch.Tensor]:
    """The seeds the compiled graph draws: its torch.randint calls, in order, after manual_seed."""
    torch.manual_seed(generator_seed)
    return [torch.randint(0, 2**62, (), dtype=torch.int64) for _ in range(sites)]


def under_the_same_draws(fn, args, sites: int, monkeypatch, generator_seed: int = 123):
    """(the compiled output, eager's under the kernel's draws): compiled and called once first (Dynamo's
    tracing may draw numbers), then called after manual_seed; eager runs with F.dropout and SDPA patched to
    drop with the seeds the graph drew (``sites`` of them)."""
    compiled = rewritten(fn)
    compiled(*args)
    torch.manual_seed(generator_seed)
    out = compiled(*args)
    dropout, sdpa = _fixed_dropout(_seeds(generator_seed, sites))
    with monkeypatch.context() as patch:
        patch.setattr(F, "dropout", dropout)
        patch.setattr(F, "scaled_dot_product_attention", sdpa)
        ref = fn(*args)
    return out, ref


@pytest.mark.parametrize("name", list(MODELS))
def test_training_with_attention_dropout_is_rewritten_and_equals_eager_under_the_same_draws(name, monkeypatch):
    make, kind = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    g = torch.Generator().manual_seed(1)
    hidden, mask_input = _inputs(kind, g)
    report = explain(model, hidden, mask_input)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "dropout p=" in report.rewrites[0].detail

    counters.clear()
    out, ref = under_the_same_draws(model, (hidden, mask_input), 1, monkeypatch)
    assert counters["gemcompile"]["jagged_attention"] == 1
    rows = _rows_eager_defines(kind, mask_input)
    out, ref = torch.where(rows, out, 0), torch.where(rows, ref, 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [hidden, *model.parameters()])


def _rows_eager_defines(kind, mask_input):
    """(B, L, 1): every row; the masks here keep a key for every row, or a finite fill defines the rows of
    the empty sequence, or the model zeroes them."""
    return torch.ones(B, L, 1, dtype=torch.bool)


def check_new_draws_every_step_and_unbiased(compiled, model, hidden, lengths):
    """Two steps drop different weights; over many steps the output's mean approaches the output without
    dropout (the kernel's dropout is unbiased, as eager's)."""
    with torch.no_grad():
        first, second = compiled(hidden, lengths), compiled(hidden, lengths)
        assert not torch.allclose(first, second)
        mean = sum(compiled(hidden, lengths) for _ in range(400)) / 400
        model.eval()
        plain = model(hidden, lengths)
    assert (mean - plain).abs().mean().item() < 0.1 * plain.abs().mean().item()
    model.train()


def test_a_new_seed_every_step_and_the_keep_rate_of_p():
    torch.manual_seed(0)
    model = MergedHeadsDropout(p=0.5).train()
    hidden, lengths = _inputs("lengths", torch.Generator().manual_seed(2))
    check_new_draws_every_step_and_unbiased(rewritten(model), model, hidden, lengths)


def test_eval_runs_no_dropout_and_equals_eager():
    torch.manual_seed(0)
    model = Bert4RecAttention(H, D, dropout=0.5).eval()
    hidden, ids = _inputs("ids", torch.Generator().manual_seed(3))
    report = explain(model, hidden, ids)
    assert report.counts["jagged_attention"] == 1 and "dropout" not in report.rewrites[0].detail
    torch.testing.assert_close(rewritten(model)(hidden, ids), model(hidden, ids), atol=2e-5, rtol=1e-4)


def _window_with_dropout(q, k, v, lengths):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (j <= i) & (i - j < 4) & (j < lengths[:, None, None, None])
    s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, float("-inf"))
    return F.dropout(s.softmax(-1), p=0.25, training=True) @ v


def test_a_sliding_window_with_dropout_runs_the_block_kernel_under_the_same_draws(monkeypatch):
    """The block family draws dropout as the jagged one does (its general kernels)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 9, 10, 11])  # every row keeps a key in its window: eager defines it
    report = explain(_window_with_dropout, q, k, v, lengths, config=GemConfig(block_attention={"enabled": True}))
    assert report.counts["block_attention"] == 1, [r.reason for r in report.refusals]
    assert "dropout p=0.25" in report.rewrites[0].detail
    out, ref = under_the_same_draws(_window_with_dropout, (q, k, v, lengths), 1, monkeypatch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def test_packed_by_unpad_the_draws_are_the_padded_ones(monkeypatch):
    """Two pre-norm blocks whose token-wise layers unpad packs: the attention reads packed tokens, and its
    dropout draws by position inside the sequence, so eager under the same draws still equals it."""
    from tests.integration.test_activation_memory import DropoutBlock, Model, _inputs as block_inputs

    torch.manual_seed(0)
    model, (x, lengths) = Model(), block_inputs()
    model.blocks = nn.ModuleList([DropoutBlock(), DropoutBlock()])
    report = explain(model, x, lengths)
    assert report.counts["jagged_attention"] == 2 and report.counts["unpad"] == 1
    out, ref = under_the_same_draws(model, (x, lengths), 2, monkeypatch)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    leaves = [x, *model.parameters()]
    for got, want in zip(torch.autograd.grad(out, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _dropout_of_one(q, k, v, lengths, p):
    s = (q @ k.transpose(-1, -2)).masked_fill((torch.arange(L)[None, :] >= lengths[:, None])[:, None, None, :],
                                              float("-inf"))
    return F.dropout(s.softmax(-1), p=1.0, training=True) @ v


def test_dropout_of_one_is_left_to_eager_with_the_reason():
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    report = explain(_dropout_of_one, q, k, v, _lengths(), torch.tensor(1.0))
    assert report.counts["jagged_attention"] == 0
    assert any("drops every weight" in r.reason for r in report.refusals), [r.reason for r in report.refusals]


class PairwiseMaskDropout(nn.Module):
    """DeBERTa-v2: the pairwise mask valid[:, :, None] & valid[:, None, :] written over the scores with
    finfo.min, then dropout: the rows it drops are uniform over every key in eager, and dropped too."""

    def __init__(self):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(E, 3 * E), nn.Dropout(0.3)

    def forward(self, x, attention_mask):
        q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pairwise = (attention_mask[:, None, :, None] * attention_mask[:, None, None, :]).bool()
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~pairwise, torch.finfo(x.dtype).min)
        return (self.dropout(s.softmax(-1)) @ v).transpose(1, 2).reshape(B, L, E)


def test_rows_a_query_mask_drops_are_dropped_uniform_attention_as_in_eager(monkeypatch):
    torch.manual_seed(0)
    model = PairwiseMaskDropout().train()
    hidden, mask = _inputs("attention_mask", torch.Generator().manual_seed(6))
    report = explain(model, hidden, mask)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = under_the_same_draws(model, (hidden, mask), 1, monkeypatch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)  # every row, the dropped ones included
    assert_same_weighted_grads(out, ref, [hidden, *model.parameters()])
