"""Hugging Face BERT, RoBERTa, DistilBERT and ALBERT themselves (eager and SDPA attention, right and left
padding), and the causal decoders GPT-2, Llama, Qwen2, Mistral (whose masks transformers builds under
torch.vmap), StableLM and Falcon (the pre-4.53 mask): every attention rewritten and compiled == eager, outputs and gradients on the valid tokens. Needs the
``transformers`` package, which gemcompile does not depend on: skipped without it (CI does not install it;
tests/integration/test_real_model_masks.py covers the same mask spellings with modules written here).
Checked with transformers 4.57.6: ``pip install --target /tmp/hf transformers==4.57.6`` then
``PYTHONPATH=/tmp/hf python -m pytest tests/integration/test_hf_transformers.py``."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemcompile import explain, gem_compile  # noqa: E402

B, L = 4, 16


DECODERS = {"gpt2": ("GPT2Config", "GPT2Model", dict(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                                     embd_pdrop=0.0, attn_pdrop=0.0, n_positions=64)),
            "llama": ("LlamaConfig", "LlamaModel", {}), "qwen2": ("Qwen2Config", "Qwen2Model", {}),
            "mistral": ("MistralConfig", "MistralModel", dict(sliding_window=None)),
            "stablelm": ("StableLmConfig", "StableLmModel", dict(hidden_dropout=0.0)),
            "falcon": ("FalconConfig", "FalconModel", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                          num_kv_heads=2, new_decoder_architecture=True,
                                                          attention_dropout=0.0, hidden_dropout=0.0))}
"""StableLM and Falcon build the mask the way transformers did before 4.53 (an integer attention_mask added to
a finfo.min triangle, refilled through a slice assignment), the others under torch.vmap."""


def _model(family: str, attention: str):
    small = dict(vocab_size=120, max_position_embeddings=64, attn_implementation=attention)
    if family in DECODERS:
        config_name, model_name, sizes = DECODERS[family]
        if family not in ("gpt2", "falcon"):
            sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, **sizes)
        if family == "gpt2":
            small.pop("max_position_embeddings")
        config = getattr(transformers, config_name)(**sizes, **small)
        return getattr(transformers, model_name)(config)
    if family == "albert":
        config = transformers.AlbertConfig(hidden_size=64, embedding_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0, **small)
        return transformers.AlbertModel(config)
    if family == "distilbert":
        config = transformers.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                                               attention_dropout=0.0, **small)
        return transformers.DistilBertModel(config)
    config_cls, model_cls = {"bert": (transformers.BertConfig, transformers.BertModel),
                             "roberta": (transformers.RobertaConfig, transformers.RobertaModel)}[family]
    config = config_cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small)
    return model_cls(config)


FAMILIES = [(f, a) for f in ("bert", "roberta", "distilbert", "albert", "gpt2", "llama", "qwen2", "mistral",
                             "stablelm", "falcon")
            for a in ("eager", "sdpa") if (f, a) != ("gpt2", "eager")]
"""GPT-2's eager attention both writes the causal fill over its scores and adds the 4-D mask: refused, with
its reason (a row with no valid key gets other gradients in the two spellings)."""


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family, attention", FAMILIES)
def test_hf_model_is_rewritten_and_equals_eager(family, attention, padding):
    torch.manual_seed(0)
    model = _model(family, attention).train()
    lengths = torch.tensor([L, 9, 3, 12])
    pos = torch.arange(L)[None, :]
    valid = pos < lengths[:, None] if padding == "right" else pos >= L - lengths[:, None]
    ids = torch.randint(5, 100, (B, L)) * valid + ~valid  # id 1 on padding (RoBERTa's pad id)
    mask = valid.long()
    report = explain(model, ids, attention_mask=mask)
    assert report.counts["jagged_attention"] == 2, [r.reason for r in report.refusals]
    ref = model(ids, attention_mask=mask).last_hidden_state
    out = gem_compile(model)(ids, attention_mask=mask).last_hidden_state
    keep = valid[..., None]  # a decoder's left-padded rows see no valid key: eager averages padding there
    torch.testing.assert_close(torch.where(keep, out, 0), torch.where(keep, ref, 0), atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((torch.where(keep, out, 0) * weights).sum(), params, allow_unused=True)
    grads_ref = torch.autograd.grad((torch.where(keep, ref, 0) * weights).sum(), params, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        if g_ref is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, g_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_hf_encoder_training_with_its_default_dropouts_is_rewritten(family, attention):
    """The configs' default dropouts (attention 0.1, hidden 0.1) in train(): the attention dropout is drawn in
    the kernel, so both layers are rewritten, and a step trains (finite gradients on every parameter)."""
    torch.manual_seed(0)
    small = dict(vocab_size=120, max_position_embeddings=64, attn_implementation=attention)
    if family == "distilbert":
        model = transformers.DistilBertModel(transformers.DistilBertConfig(dim=64, n_layers=2, n_heads=4,
                                                                           hidden_dim=128, **small))
    else:
        model = transformers.BertModel(transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=128, **small))
    model.train()
    lengths = torch.tensor([L, 9, 3, 12])
    valid = torch.arange(L)[None, :] < lengths[:, None]
    ids, mask = torch.randint(5, 100, (B, L)) * valid, valid.long()
    report = explain(model, ids, mask)
    assert report.counts["jagged_attention"] == 2, [r.reason for r in report.refusals]
    assert all("dropout p=0.1" in r.detail for r in report.rewrites if r.pass_name == "jagged_attention")
    out = gem_compile(model)(ids, attention_mask=mask).last_hidden_state
    (out * valid[..., None]).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
               and p.grad is not None)


def test_hf_xlnet_whose_padded_rows_attend_to_themselves_is_rewritten_and_equals_eager():
    """XLNet's content stream keeps the diagonal besides the key padding (a padded row attends to the valid
    tokens and to itself): both layers are rewritten (the kept diagonal merged after the kernel), and compiled
    == eager on every row, outputs and every gradient."""
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=2, d_inner=64, dropout=0.0)
    model = transformers.XLNetModel(config).eval()
    ids = torch.randint(5, 90, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:], mask[2, 2:] = 0, 0
    report = explain(model, ids, attention_mask=mask)
    assert report.counts["jagged_attention"] == 2, [r.reason for r in report.refusals]
    assert all("or i == j" in r.detail for r in report.rewrites if r.pass_name == "jagged_attention")
    out = gem_compile(model)(ids, attention_mask=mask).last_hidden_state
    _assert_same_outputs_and_grads(out, model(ids, attention_mask=mask).last_hidden_state, model)


def _assert_same_outputs_and_grads(out, ref, model):
    """out == ref, and the gradients of a random weighting of them equal on every parameter."""
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    grads = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
    grads_ref = torch.autograd.grad((ref * weights).sum(), params, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        if g_ref is not None:
            torch.testing.assert_close(g, g_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_bert_under_sentence_transformers_mean_pooling_runs_packed(attention):
    """sentence-transformers' mean pooling (the integer attention_mask cast to float and expanded over the
    features) zeroes the padded rows: every GEMM of the encoder runs on the valid tokens only, under the
    device check that the mask is 0/1, and the sentence vectors and gradients equal eager's (an empty
    sentence too, whose rows read every key in eager)."""
    from tests.rewritten import rewritten

    torch.manual_seed(0)
    bert = _model("bert", attention)

    def encode(ids, attention_mask):
        token_embeddings = bert(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        return torch.sum(token_embeddings * input_mask_expanded, 1) / torch.clamp(input_mask_expanded.sum(1), min=1e-9)

    def batch(lengths):
        valid = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
        return torch.randint(5, 100, (B, L)) * valid, valid.long()

    report = explain(encode, *batch([L, 9, 3, 12]))
    (region,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert region.metrics["gemms"] == 12 and report.counts["jagged_attention"] == 2, region.detail
    compiled = rewritten(encode)
    for lengths in ([L, 9, 3, 12], [4, 0, L, 7]):
        inputs = batch(lengths)
        _assert_same_outputs_and_grads(compiled(*inputs), encode(*inputs), bert)


def test_hf_bert_trained_on_batches_of_their_own_padded_length_runs_packed_after_the_recompile():
    """A tokenizer padding each batch to its longest sequence: the second batch's shapes make Dynamo recompile
    with symbolic B and N. The key mask the attention rewrite slices from attention_mask (its length a size of
    its own) moves before the region that packs the K and V projections, so the dynamic graph packs them as the
    static one does; every batch's outputs and gradients equal eager's."""
    from torch._dynamo.utils import counters

    from gemcompile.backend import allow_warnings_in_graphs
    from tests.rewritten import rewritten

    torch.manual_seed(0)
    bert = _model("bert", "sdpa")
    allow_warnings_in_graphs()
    counters.clear()
    compiles = []
    compiled = rewritten(lambda ids, mask: bert(input_ids=ids, attention_mask=mask).last_hidden_state, compiles)
    g = torch.Generator().manual_seed(1)
    packed = []  # regions packed by each compile
    for lengths in ([7, 5, 3], [9, 2, 9, 4], [12, 1, 6]):
        n = max(lengths)
        valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
        ids, mask = torch.randint(5, 100, (len(lengths), n), generator=g) * valid, valid.long()
        before = counters["gemcompile"]["unpad"]
        out, ref = compiled(ids, mask), bert(input_ids=ids, attention_mask=mask).last_hidden_state
        packed.append(counters["gemcompile"]["unpad"] - before)
        _assert_same_outputs_and_grads(out * valid[..., None], ref * valid[..., None], bert)
    assert len(compiles) == 2 and packed[0] >= 1 and packed[1] >= packed[0] and packed[2] == 0, packed
