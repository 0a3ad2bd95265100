"""Attention as recommendation and transformer code writes it, masks read from data included.

The modules (tests/model_styles.py) are written for these tests from the public behaviour of the models
they are named after (no third-party code is copied): a Hugging Face style BERT self-attention (its
extended attention mask, eager and SDPA), DistilBERT's filled mask, T5's relative-position bias summed
with its padding mask (added in place, softmax in fp32 cast back with type_as), the transformers 5 style
boolean mask indexed by batch and key index tensors, SASRec blocks (nn.MultiheadAttention with a causal mask and a key
padding mask from item ids, the 2020 version with a timeline mask, RecBole's -1e4 tril mask), BERT4Rec's
mask from ``x > 0`` with ``.repeat``, HSTU layers (lengths from offsets, causal written as
``eye | (i - j > 0)``, the target mask without a padding term, the research encoder's registered triu
buffer), left-padded batches, and nn.TransformerEncoderLayer with a
causal mask next to a boolean padding mask. Each: every attention is rewritten (explain), compiled ==
eager for outputs and every gradient (float32), and 20 batches whose masks change compile once."""

import functools
import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from gemcompile import explain, gem_compile
from gemcompile.backend import GemBackend, allow_warnings_in_graphs
from tests import fbgemm_standin
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import (
    Bert4RecAttention,
    BertStyleSelfAttention,
    DinStyleAttention,
    DistilBertStyleAttention,
    EncoderLayerCausal,
    EncoderStackCausal,
    TransActStyle,
    MeantimeStyle,
    FuxiCtrBstStyle,
    FuxiCtrStyleAttention,
    HstuResearchStyle,
    HstuStyleAttention,
    HstuTargetsStyle,
    HstuUpstreamStyle,
    IndexedBoolMaskAttention,
    LeftPaddedCausal,
    RecBoleStyleAttention,
    SASRecBlock,
    StosaStyleAttention,
    T5StyleAttention,
    TfSasRecStyleAttention,
)
from tests.rewritten import rewritten

B, L, H, D = 4, 12, 2, 16
E = H * D


def _right_padded(lengths):
    return torch.arange(L)[None, :] < lengths[:, None]


def _left_padded(lengths):
    return torch.arange(L)[None, :] >= L - lengths[:, None]


def _batch(kind: str, g: torch.Generator):
    """(hidden, mask input) for a model's input kind; lengths include a full and, where eager is defined
    there, an empty sequence; the key masks of 'holes' have padding inside the sequence too."""
    hidden = torch.randn(B, L, E, generator=g, requires_grad=True)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = L
    if kind == "attention_mask":  # HF: 1 token / 0 padding, with holes, one empty sequence
        mask = (torch.rand(B, L, generator=g) > 0.3) & _right_padded(lengths)
        mask[1] = False
        return hidden, mask.long()
    if kind == "ids_left":  # item ids, 0 padding, right-aligned (SASRec's and BERT4Rec's loaders)
        return hidden, torch.randint(1, 50, (B, L), generator=g) * _left_padded(lengths)
    if kind == "ids_right":
        return hidden, torch.randint(1, 50, (B, L), generator=g) * _right_padded(lengths)
    if kind == "ids_holes":
        return hidden, torch.randint(0, 3, (B, L), generator=g) * torch.randint(1, 50, (B, L), generator=g)
    if kind == "lengths":
        return hidden, lengths
    if kind == "offsets":
        return hidden, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    raise ValueError(kind)


MODELS = {
    "bert_eager": (functools.partial(BertStyleSelfAttention, sdpa=False), "attention_mask", "jagged_attention"),
    "bert_sdpa": (functools.partial(BertStyleSelfAttention, sdpa=True), "attention_mask", "jagged_attention"),
    "transformers5_indexed": (IndexedBoolMaskAttention, "attention_mask", "jagged_attention"),
    "transformers5_query_term": (functools.partial(IndexedBoolMaskAttention, query_floor=0), "attention_mask",
                                 "jagged_attention"),
    "distilbert": (DistilBertStyleAttention, "attention_mask", "jagged_attention"),
    "t5_relative_bias": (T5StyleAttention, "attention_mask", "jagged_attention"),
    "t5_relative_bias_sdpa": (functools.partial(T5StyleAttention, sdpa=True), "attention_mask",
                              "jagged_attention"),
    "t5_bias_gated_by_bool_mask": (functools.partial(T5StyleAttention, gated=True), "attention_mask",
                                   "jagged_attention"),
    "sasrec": (SASRecBlock, "ids_right", "jagged_attention"),
    "sasrec_2020_timeline": (functools.partial(SASRecBlock, key_padding=False), "ids_left", "jagged_attention"),
    "bert4rec": (Bert4RecAttention, "ids_holes", "jagged_attention"),
    "recbole_sasrec": (RecBoleStyleAttention, "ids_right", "jagged_attention"),
    "fuxictr_expanded_mask": (FuxiCtrStyleAttention, "ids_holes", "jagged_attention"),
    "tf_sasrec_query_masking": (TfSasRecStyleAttention, "ids_left", "jagged_attention"),
    "fuxictr_target_attention": (functools.partial(FuxiCtrStyleAttention, target=True), "ids_holes",
                                 "jagged_attention"),
    "fuxictr_bst_kept_diagonal": (FuxiCtrBstStyle, "ids_left", "jagged_attention"),
    "hstu_offsets": (HstuStyleAttention, "offsets", "gdpa"),
    "hstu_research_buffer": (functools.partial(HstuResearchStyle, max_len=L), "lengths", "gdpa"),
    "left_padded_causal": (LeftPaddedCausal, "lengths", "jagged_attention"),
    "encoder_layer_causal": (EncoderLayerCausal, "ids_right", "jagged_attention"),
    "encoder_stack_causal_float": (EncoderStackCausal, "ids_right", "jagged_attention"),
    "encoder_stack_causal_bool": (functools.partial(EncoderStackCausal, bool_mask=True), "ids_right",
                                  "jagged_attention"),
    "transact_first_action_kept": (TransActStyle, "ids_left", "jagged_attention"),
    "meantime_tril_in_place": (MeantimeStyle, "ids_left", "jagged_attention"),
}


def _defined_rows(name, mask_input):
    """(B, L, 1) rows where eager's output is defined (a left-padded causal row before the first token
    sees no key: SDPA gives 0 or NaN there)."""
    if name == "left_padded_causal":
        first = L - mask_input
        return (torch.arange(L)[None, :] >= first[:, None])[..., None]
    return torch.ones(B, L, 1, dtype=torch.bool)


def _check_against_eager(name, seed: int = 1, device: str = "cpu"):
    """The compiled model runs the one rewritten attention; outputs and gradients equal eager's (float32) on
    the rows eager defines."""
    make, kind, family = MODELS[name]
    torch.manual_seed(0)
    model = make(H, D).eval().to(device)
    hidden, mask_input = _batch(kind, torch.Generator().manual_seed(seed))
    hidden = hidden.detach().to(device).requires_grad_()
    mask_input = mask_input.to(device)
    allow_warnings_in_graphs()  # as gem_compile does (TransformerEncoderLayer warns while it runs)
    counters.clear()
    compiled = rewritten(model)
    # eager SDPA's fused CPU kernel rebuilds P from a logsumexp that cannot hold log(L) next to finfo.min:
    # on a sequence with no valid key its backward is L times its own forward's Jacobian. The reference is
    # SDPA's math definition (what a hand-written softmax gives too).
    with sdpa_kernel(SDPBackend.MATH):
        ref = model(hidden, mask_input)
    out = compiled(hidden, mask_input)
    assert counters["gemcompile"][family] == 1  # the compiled model runs the rewritten attention
    rows = _defined_rows(name, mask_input.cpu()).to(device)
    torch.testing.assert_close(torch.where(rows, out, 0), torch.where(rows, ref, 0), atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(torch.where(rows, out, 0), torch.where(rows, ref, 0),
                               [hidden, *model.parameters()])


@pytest.mark.parametrize("name", list(MODELS))
def test_model_is_rewritten_with_eager_outputs_and_gradients(name):
    make, kind, family = MODELS[name]
    torch.manual_seed(0)
    hidden, mask_input = _batch(kind, torch.Generator().manual_seed(1))
    report = explain(make(H, D).eval(), hidden, mask_input)
    assert report.counts[family] == 1, [r.reason for r in report.refusals]
    _check_against_eager(name)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on a machine without CUDA (conftest sets it)")
@pytest.mark.parametrize("name", list(MODELS))
def test_model_through_the_triton_launchers(name, monkeypatch):
    """The same check with the ops running their Triton launchers (interpreter, float32) instead of the CPU
    reference: the tensors the graph derives once per step (orders, key bounds, q_lengths folded from
    zeroed rows) reach the kernels, which the reference ignores."""
    pytest.importorskip("triton")
    from gemcompile.lowering.block_attention import op as block_op
    from gemcompile.lowering.gdpa import op as gdpa_op
    from gemcompile.lowering.jagged_attention import op as jagged_op

    for module in (jagged_op, gdpa_op, block_op):
        monkeypatch.setattr(module, "use_triton", lambda q: q.dtype != torch.float64)
    _check_against_eager(name, seed=7)


def _twenty_batches(compiled, model, name: str, kind: str, seed: int) -> None:
    """20 batches whose masks change: compiled == eager on each (the rows eager defines)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        hidden, mask_input = _batch(kind, g)
        rows = _defined_rows(name, mask_input)
        out, ref = compiled(hidden, mask_input), model(hidden, mask_input)
        torch.testing.assert_close(torch.where(rows, out, 0), torch.where(rows, ref, 0), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["bert4rec", "sasrec"])
def test_twenty_batches_of_changing_masks_compile_once(name, monkeypatch):
    calls = []
    original = GemBackend.__call__
    monkeypatch.setattr(GemBackend, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    make, kind, _ = MODELS[name]
    torch.manual_seed(0)
    model = make(H, D).eval()
    with torch.no_grad():
        _twenty_batches(gem_compile(model), model, name, kind, seed=3)
    assert len(calls) == 1


@pytest.mark.parametrize("name", [n for n in MODELS if n not in ("bert4rec", "sasrec")])
def test_every_model_compiles_once_over_twenty_batches_of_changing_masks(name):
    """The rest of the table, through the passes with aot_eager (Dynamo's guards are what recompiles; the
    two models above run the whole gem_compile)."""
    make, kind, family = MODELS[name]
    torch.manual_seed(0)
    model = make(H, D).eval()
    allow_warnings_in_graphs()  # as gem_compile does (TransformerEncoderLayer warns while it runs)
    compiles = []
    compiled = rewritten(model, compiles)
    counters.clear()
    # grad mode on, as in training: under no_grad, eval-mode nn.TransformerEncoderLayer takes torch's fused
    # inference kernel (torch._transformer_encoder_layer_fwd), which has no attention to rewrite
    _twenty_batches(compiled, model, name, kind, seed=4)
    assert len(compiles) == 1
    assert counters["gemcompile"][family] == 1  # rewritten once, in the one graph


def test_a_registered_causal_buffer_changed_in_place_stops_the_run():
    torch.manual_seed(0)
    model = HstuResearchStyle(H, D, max_len=L).eval()
    hidden, lengths = _batch("lengths", torch.Generator().manual_seed(1))
    compiled = gem_compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden, lengths), model(hidden, lengths), atol=2e-5, rtol=1e-4)
        model._attn_mask.fill_(False)  # the buffer no longer holds the causal triangle the proof read
        with pytest.raises(Exception, match="no longer holds"):
            compiled(hidden, lengths)


def test_data_masks_that_are_not_a_per_key_vector_are_refused_with_the_tensor_named():
    def pairwise(q, k, v, ids):  # same-item pairs: data at both the query and the key position
        same_item = (ids[:, :, None] == ids[:, None, :])[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same_item)

    def per_head(q, k, v, ids):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ids[:, :, None, :] > 0)

    def after_softmax(q, k, v, ids):
        p = torch.softmax(q @ k.transpose(-2, -1), dim=-1) * (ids > 0)[:, None, None, :]
        return p @ v

    def small_fill(q, k, v, ids):
        s = (q @ k.transpose(-2, -1)).masked_fill((ids == 0)[:, None, None, :], -10.0)
        return s.softmax(-1) @ v

    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    ids = torch.randint(0, 5, (B, L))
    for fn, reason, arg in ((pairwise, "at both the query and the key position", ids),
                            (per_head, "differs between heads", torch.randint(0, 5, (B, H, L))),
                            (after_softmax, "", ids), (small_fill, "large negative", ids)):
        report = explain(fn, q, k, v, arg)
        assert sum(report.counts.values()) == 0, fn.__name__
        assert report.refusals and reason in report.refusals[0].reason, (fn.__name__, report.refusals)


def test_a_causal_mask_passed_in_is_read_and_checked_at_every_call():
    """The PyTorch tutorial spelling: generate_square_subsequent_mask(L) made outside, passed as src_mask."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 2 * E, dropout=0.0, batch_first=True).eval()

    def encode(hidden, padding, causal):
        return layer(hidden, src_mask=causal, src_key_padding_mask=padding)

    hidden, ids = _batch("ids_right", torch.Generator().manual_seed(1))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L)
    report = explain(encode, hidden, ids == 0, causal)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "causal" in report.rewrites[0].detail
    compiled = gem_compile(encode)  # with gradients: under no_grad, eval() runs torch's fused encoder instead
    torch.testing.assert_close(compiled(hidden, ids == 0, causal), encode(hidden, ids == 0, causal),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(Exception, match="no longer holds the triangle"):
        compiled(hidden, ids == 0, torch.zeros(L, L))


@pytest.mark.parametrize("drop_rows", [True, False])
def test_hstu_target_mask_without_a_padding_term(drop_rows):
    """Upstream's target mask has no j < length term: equal to HSTU's mask on rows i < length only, so it
    is rewritten when the model drops the other rows after the attention, and refused (with why) if not."""
    torch.manual_seed(0)
    model = HstuTargetsStyle(H, D, drop_rows=drop_rows).eval()
    hidden, offsets = _batch("offsets", torch.Generator().manual_seed(1))
    targets = torch.tensor([2, 1, 0, 3]).clamp(max=offsets[1:] - offsets[:-1])
    report = explain(model, hidden, offsets, targets)
    if not drop_rows:
        assert report.counts["gdpa"] == 0
        assert any("no key-padding term" in r.reason for r in report.refusals), report.refusals
        return
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(hidden, offsets, targets), model(hidden, offsets, targets)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    leaves = [hidden, *model.parameters()]
    grads = torch.autograd.grad(out.square().sum(), leaves)
    for g, g_ref in zip(grads, torch.autograd.grad(ref.square().sum(), leaves)):
        torch.testing.assert_close(g, g_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("weight_normalization", [False, True])
def test_din_target_attention_has_no_site_for_the_kernels_and_compiles_exactly(weight_normalization):
    """DIN scores history items with an MLP, not q k^T: no attention site, no rewrite, nothing refused as if
    it were one; compiled == eager for outputs and gradients."""
    torch.manual_seed(0)
    model = DinStyleAttention(H, D, weight_normalization=weight_normalization)
    hidden, lengths = _batch("lengths", torch.Generator().manual_seed(5))
    report = explain(model, hidden, lengths)
    assert not any(report.counts.values()), report.counts
    assert not [r for r in report.refusals if "attention" in r.pass_name], [r.reason for r in report.refusals]
    ref = model(hidden, lengths)
    out = gem_compile(model)(hidden, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    leaves = [hidden, *model.parameters()]
    grads = torch.autograd.grad(out.square().sum(), leaves)
    grads_ref = torch.autograd.grad(ref.square().sum(), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


def test_a_query_term_that_drops_rows_is_not_taken_for_one_that_keeps_them():
    """q_idx >= 0 holds at every query (index ranges decide it); q_idx >= 1 drops query row 0: not the
    same mask. It is a per-query vector (rows i >= 1 kept), named as such, and row 0 is 0 as eager's safe
    softmax gives it."""
    torch.manual_seed(0)
    model = IndexedBoolMaskAttention(H, D, query_floor=1)
    hidden, mask_input = _batch("attention_mask", torch.Generator().manual_seed(1))
    report = explain(model, hidden, mask_input)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "queries where (-i < 0)" in report.rewrites[0].detail, report.rewrites[0].detail
    with sdpa_kernel(SDPBackend.MATH):
        ref = model(hidden, mask_input)
    out = rewritten(model)(hidden, mask_input)
    assert (out[:, 0] == 0).all() and (ref[:, 0] == 0).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [hidden, *model.parameters()])


HSTU_VISIBILITY = {
    "causal": {}, "bidirectional": {"causal": False}, "bidirectional_window": {"causal": False, "max_attn_len": 3},
    "causal_window": {"max_attn_len": 3}, "contextual": {"contextual": 3},
}


@pytest.mark.parametrize("visibility, with_targets", [(name, False) for name in HSTU_VISIBILITY]
                         + [("causal", True), ("causal_window", True), ("contextual", True)])
def test_hstu_as_generative_recommenders_writes_it_with_fbgemm_padding_and_packing(visibility, with_targets):
    """q, k, v padded by fbgemm's jagged_to_padded_dense, the visibility mask (causal with targets, or not causal:
    the distance made absolute by torch.where, a window, a contextual prefix) without a padding term, the
    output packed back by dense_to_jagged (which drops the padded rows): rewritten to gdpa with the rows past
    each length skipped; compiled == eager for outputs and every gradient, an empty sequence included.
    (fbgemm_gpu's own ops where installed, tests/fbgemm_standin.py otherwise.)"""
    fbgemm_standin.ensure()
    torch.manual_seed(0)
    model = HstuUpstreamStyle(H, D, max_len=L, **HSTU_VISIBILITY[visibility])
    lengths = torch.tensor([L, 5, 0, 9])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.randn(int(lengths.sum()), H * D, requires_grad=True)
    targets = torch.tensor([2, 1, 0, 3]) if with_targets else None
    report = explain(model, x, offsets, targets)
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    (detail,) = [r.detail for r in report.rewrites if r.pass_name == "gdpa"]
    if with_targets or visibility == "contextual":  # the row drop makes the mask without a padding term exact
        assert "the packing into jagged tokens (dense_to_jagged)" in detail, detail
    assert ("window" in detail) == ("max_attn_len" in HSTU_VISIBILITY[visibility]), detail
    assert ("causal" in detail) == HSTU_VISIBILITY[visibility].get("causal", True), detail
    ref = model(x, offsets, targets)
    counters.clear()
    out = rewritten(model)(x, offsets, targets)
    assert counters["gemcompile"]["gdpa"] == 1
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    leaves = [x, *model.parameters()]
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    for g, g_ref in zip(grads, torch.autograd.grad((ref * weights).sum(), leaves)):
        torch.testing.assert_close(g, g_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("visibility", [{"contextual": 3}, {"max_attn_len": 3}])
def test_hstu_mask_with_targets_stops_on_a_negative_target_count(visibility):
    """With a contextual prefix and targets, upstream's mask equals HSTU's on the kept rows only for target
    counts >= 0 (a negative count lets the prefix see padded keys); with a window the kernels' tile ranges
    assume it: the rewrite checks it on the device at every call, so a negative count stops the run with the
    reason instead of a mask the model did not mean."""
    fbgemm_standin.ensure()
    torch.manual_seed(0)
    model = HstuUpstreamStyle(H, D, max_len=L, **visibility)
    lengths = torch.tensor([L, 5, 0, 9])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.randn(int(lengths.sum()), H * D)
    compiled = rewritten(model)
    torch.testing.assert_close(compiled(x, offsets, torch.tensor([2, 1, 0, 3])),
                               model(x, offsets, torch.tensor([2, 1, 0, 3])), atol=2e-5, rtol=1e-4)
    with pytest.raises(Exception, match="negative target count"):
        compiled(x, offsets, torch.tensor([2, -1, 0, 3]))


def test_hstu_upstream_form_compiles_once_over_twenty_batches():
    """Jagged inputs change their token count every batch: marked dynamic (torch.compile's own way; without
    it Dynamo compiles once more when the count first changes), 20 batches with changing lengths and targets
    compile once and equal eager."""
    fbgemm_standin.ensure()
    torch.manual_seed(0)
    model = HstuUpstreamStyle(H, D, max_len=L)
    compiles = []
    compiled = rewritten(model, compiles)
    g = torch.Generator().manual_seed(6)
    counters.clear()
    for _ in range(20):
        lengths = torch.randint(0, L + 1, (B,), generator=g)
        lengths[0] = L
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        x = torch.randn(int(lengths.sum()), H * D, generator=g)
        targets = torch.minimum(torch.randint(0, 4, (B,), generator=g), lengths)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, offsets, targets), model(x, offsets, targets), atol=2e-5, rtol=1e-4)
    assert len(compiles) == 1
    assert counters["gemcompile"]["gdpa"] == 1


class NanoGptAttention(torch.nn.Module):
    """nanoGPT's / GPT-2's causal self-attention: the triangle registered as tril(ones(n, n)).view(1, 1, n, n) and
    sliced [:, :, :T, :T], filled where it is 0; a key padding mask from the ids besides."""

    def __init__(self, n_max: int = 16):
        super().__init__()
        self.c_attn = torch.nn.Linear(E, 3 * E)
        self.register_buffer("bias", torch.tril(torch.ones(n_max, n_max)).view(1, 1, n_max, n_max))

    def forward(self, x, ids):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = att.masked_fill((ids == 0)[:, None, None, :], float("-inf"))
        return (torch.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(b, t, c)


def test_a_causal_buffer_registered_four_dimensional_is_read_as_the_triangle():
    """The (1, 1, n, n) buffer is the triangle (it was read as data and refused), checked at every call."""
    torch.manual_seed(0)
    model = NanoGptAttention()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, E, generator=g)
    ids = torch.randint(1, 9, (B, L), generator=g) * (torch.arange(L)[None, :] < torch.tensor([L, 1, 5, 9])[:, None])
    report = explain(model, x, ids)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "causal" in report.rewrites[0].detail
    compiled = gem_compile(model)
    valid = (ids != 0)[..., None]  # rows with a valid key (right padding: every valid query row)
    torch.testing.assert_close(compiled(x, ids) * valid, model(x, ids) * valid, atol=2e-5, rtol=1e-4)
    model.bias.fill_(1.0)  # no longer the triangle the proof read
    with pytest.raises(Exception, match="no longer holds the triangle"):
        compiled(x, ids)


@pytest.mark.parametrize("cov_values", [True, False])
def test_a_distance_between_query_and_key_is_refused_with_the_op_named(cov_values):
    """STOSA's scores are a negated Wasserstein distance, not a scaled q k^T: the softmax is a candidate (its
    weights meet values) and the refusal names why (it said nothing before): the weights reused squared,
    or, without that, the op the kernels do not compute; compiled == eager."""
    torch.manual_seed(0)
    model = StosaStyleAttention(H, D, cov_values=cov_values)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, L, E, generator=g)
    ids = torch.randint(1, 9, (B, L), generator=g) * (torch.arange(L)[None, :] >= L - torch.tensor([L, 1, 5, 9])[:, None])
    report = explain(model, x, ids)
    assert not any(report.counts[p] for p in ("jagged_attention", "block_attention", "gdpa")), report.counts
    (refusal,) = [r for r in report.refusals if r.pass_name == "jagged_attention"]
    expected = ("reused",) if cov_values else ("`neg`", "not a scale, bias, mask or cast")
    assert all(part in refusal.reason for part in expected), refusal.reason
    torch.testing.assert_close(gem_compile(model)(x, ids), model(x, ids), atol=2e-5, rtol=1e-4)


class TutorialSeq2Seq(torch.nn.Module):
    """pytorch/tutorials' translation_transformer.py: nn.Transformer (sequence-first) given a bool src_mask of
    zeros, a float causal tgt_mask from its own generate_square_subsequent_mask (masked_fill twice over a
    float copy of a bool triangle) and padding masks from the tokens; no is_causal hints, so torch asks
    whether each mask is causal (a read of its values that broke the graph: the whole model ran eagerly)."""

    def __init__(self, pad: int = 1):
        super().__init__()
        self.pad = pad
        self.emb = torch.nn.Embedding(50, E)
        self.transformer = torch.nn.Transformer(d_model=E, nhead=H, num_encoder_layers=1, num_decoder_layers=1,
                                                dim_feedforward=2 * E, dropout=0.0)

    @staticmethod
    def square_subsequent_mask(size: int) -> torch.Tensor:
        mask = (torch.triu(torch.ones((size, size))) == 1).transpose(0, 1)
        return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))

    def forward(self, src, tgt):
        src_mask = torch.zeros((src.shape[0], src.shape[0])).type(torch.bool)
        tgt_mask = self.square_subsequent_mask(tgt.shape[0])
        src_pad, tgt_pad = (src == self.pad).transpose(0, 1), (tgt == self.pad).transpose(0, 1)
        return self.transformer(self.emb(src), self.emb(tgt), src_mask, tgt_mask, None, src_pad, tgt_pad, src_pad)


def test_pytorch_translation_tutorial_transformer_is_rewritten_whole():
    """All three attentions (encoder self, decoder causal self, decoder cross) are rewritten in one graph,
    and compiled == eager for outputs and gradients."""
    allow_warnings_in_graphs()
    torch.manual_seed(0)
    model = TutorialSeq2Seq().train()  # dropout 0; train() keeps the layers' ops in the graph
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([L, 3, 7, 1])
    valid = torch.arange(L)[None, :] < lengths[:, None]
    src = torch.where(valid, torch.randint(2, 50, (B, L), generator=g), 1).t().contiguous()
    tgt = torch.where(valid.flip(0), torch.randint(2, 50, (B, L), generator=g), 1).t().contiguous()
    report = explain(model, src, tgt)
    assert len(report.graphs) == 1 and report.counts["jagged_attention"] == 3, [r.reason for r in report.refusals]
    assert any("causal" in r.detail for r in report.rewrites)
    out, ref = rewritten(model)(src, tgt), model(src, tgt)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, list(model.parameters()))
