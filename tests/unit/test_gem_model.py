"""GEM-ref: shapes, honest masks (padding invariance), gradients, training, configs."""
import dataclasses

import pytest
import torch

from gemcompile.models.data import GemBatch, SyntheticData
from gemcompile.models.gem import (
    BlockSelfAttention,
    GemRef,
    GemRefConfig,
    gem_ref_config,
    masked_bce_loss,
)

TINY = gem_ref_config("tiny")
TINY_COMP_SKIP = dataclasses.replace(TINY, comp_skip=True, n_layers=3)


def tiny_batch(cfg: GemRefConfig = TINY, batch_size: int = 16, step: int = 0, **data_kw) -> GemBatch:
    return SyntheticData(cfg.data_config(batch_size, **data_kw)).batch(step)


def with_edge_lengths(batch: GemBatch) -> GemBatch:
    """Sample 0: every sequence empty; sample 1: every sequence full; sample 2: sequence 0 empty and
    sequence 1 full; sample 3: length 1. Padded positions are zero, valid ones hold valid values."""
    max_lens = [items.shape[1] for items in batch.seq_items]
    lengths = [n.clone() for n in batch.seq_lengths]
    for n, n_max in zip(lengths, max_lens):
        n[0], n[1], n[3] = 0, n_max, 1
    lengths[0][2], lengths[1][2] = 0, max_lens[1]
    items, actions, times = [], [], []
    for it, ac, ti, n in zip(batch.seq_items, batch.seq_actions, batch.seq_times, lengths):
        valid = torch.arange(it.shape[1])[None, :] < n[:, None]
        items.append(torch.where(valid, torch.where(it > 0, it, 7), 0))
        actions.append(torch.where(valid, ac, 0))
        times.append(torch.where(valid, torch.where(ti > 0, ti, 5.0), 0.0))
    return dataclasses.replace(
        batch, seq_items=items, seq_actions=actions, seq_times=times, seq_lengths=lengths
    )


def perturb_padding(batch: GemBatch, cfg: GemRefConfig, seed: int = 1) -> GemBatch:
    """Random (in-range) item/action/time values at every padded position; valid positions untouched."""
    gen = torch.Generator().manual_seed(seed)
    items, actions, times = [], [], []
    for it, ac, ti, n in zip(batch.seq_items, batch.seq_actions, batch.seq_times, batch.seq_lengths):
        pad = torch.arange(it.shape[1])[None, :] >= n[:, None]
        items.append(torch.where(pad, torch.randint(1, cfg.item_vocab, it.shape, generator=gen), it))
        actions.append(torch.where(pad, torch.randint(0, cfg.n_actions, ac.shape, generator=gen), ac))
        times.append(torch.where(pad, 1e6 * torch.rand(ti.shape, generator=gen), ti))
    return dataclasses.replace(batch, seq_items=items, seq_actions=actions, seq_times=times)


# -- forward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, TINY_COMP_SKIP], ids=["tiny", "tiny_comp_skip"])
def test_forward_shape_and_finite_with_empty_and_full_sequences(cfg):
    model = GemRef(cfg)
    batch = with_edge_lengths(tiny_batch(cfg))
    assert int(batch.seq_lengths[0][0]) == 0 and int(batch.seq_lengths[0][1]) == cfg.seq_max_lens[0]
    logits = model(**batch.features())
    assert logits.shape == (16, cfg.n_tasks) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("cfg", [TINY, TINY_COMP_SKIP], ids=["tiny", "tiny_comp_skip"])
def test_padding_invariance(cfg):
    """Values at padded positions never reach the logits: the masks are honest."""
    model = GemRef(cfg)
    batch = with_edge_lengths(tiny_batch(cfg, length_dist="heavy_tail", fill=0.3))
    reference = model(**batch.features())
    perturbed = perturb_padding(batch, cfg)
    assert any(not torch.equal(a, b) for a, b in zip(perturbed.seq_items, batch.seq_items))
    torch.testing.assert_close(model(**perturbed.features()), reference, rtol=0, atol=1e-6)
    # The check is sensitive: changing one valid event does change that sample's logits.
    changed = dataclasses.replace(batch, seq_items=[s.clone() for s in batch.seq_items])
    changed.seq_items[0][1, 0] = 1 + changed.seq_items[0][1, 0] % (cfg.item_vocab - 1)
    assert not torch.allclose(model(**changed.features())[1], reference[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [TINY, TINY_COMP_SKIP], ids=["tiny", "tiny_comp_skip"])
def test_padding_invariance_of_hidden_states(cfg):
    """Garbage in the padded rows of the sequence hidden states never reaches the logits.

    The embedding zeroes padded rows, so perturbing raw inputs alone would not notice a missing
    attention mask; this puts large noise into the padded rows right after the embedding, which every
    PMA / block-attention key-padding mask, query-padding mask and recent-token gather must then hide.
    """
    model = GemRef(cfg)
    batch = with_edge_lengths(tiny_batch(cfg, length_dist="heavy_tail", fill=0.3))
    reference = model(**batch.features())
    gen = torch.Generator().manual_seed(2)

    def add_noise_at_padding(module, inputs, seqs):
        noisy = []
        for s, n in zip(seqs, batch.seq_lengths):
            pad = torch.arange(s.shape[1])[None, :] >= n[:, None]
            noisy.append(s + 10.0 * torch.randn(s.shape, generator=gen) * pad[..., None])
        return noisy

    handle = model.seq_embedding.register_forward_hook(add_noise_at_padding)
    try:
        noisy = model(**batch.features())
    finally:
        handle.remove()
    torch.testing.assert_close(noisy, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [TINY, TINY_COMP_SKIP], ids=["tiny", "tiny_comp_skip"])
def test_padded_rows_stay_zero(cfg):
    """Every sequence block multiplies its update by valid, so padded rows are exactly 0 after each layer
    (what a jagged rewrite that never materializes them assumes)."""
    model = GemRef(cfg)
    batch = with_edge_lengths(tiny_batch(cfg, length_dist="heavy_tail", fill=0.3))
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, out: outputs.append(out[1])) for layer in model.layers]
    model(**batch.features())
    for h in hooks:
        h.remove()
    assert len(outputs) == cfg.n_layers
    for seqs in outputs:
        for s, n in zip(seqs, batch.seq_lengths):
            pad = torch.arange(s.shape[1])[None, :] >= n[:, None]
            assert torch.equal(s[pad], torch.zeros_like(s[pad]))
            assert s[~pad].abs().sum() > 0


def test_samples_are_independent():
    """A sample's logits do not depend on the rest of the batch (no mixing across the batch axis)."""
    model = GemRef(TINY)
    batch = with_edge_lengths(tiny_batch())
    full = model(**batch.features())
    part = model(**batch.select(torch.arange(5, 12)).features())
    torch.testing.assert_close(part, full[5:12], rtol=1e-5, atol=1e-5)


def test_domain_selects_tower():
    model = GemRef(TINY)
    batch = tiny_batch()
    logits = model(**batch.features())
    flipped = model(**{**batch.features(), "domain": 1 - batch.domain})
    assert not torch.allclose(logits, flipped)
    both = [model(**{**batch.features(), "domain": torch.full_like(batch.domain, d)}) for d in range(2)]
    expected = torch.where(batch.domain[:, None] == 0, both[0], both[1])
    torch.testing.assert_close(logits, expected)


def test_block_self_attention_is_local_to_blocks():
    """Block attention equals running each block on its own (RoPE is relative, so offsets cancel)."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, block_size=8)
    attn = BlockSelfAttention(cfg)
    s = torch.randn(3, 32, cfg.d)
    lengths = torch.tensor([32, 13, 0])
    valid = torch.arange(32)[None, :] < lengths[:, None]
    s = s * valid[..., None]
    full = attn(s, valid)
    for start in range(0, 32, 8):
        block_valid = valid[:, start : start + 8]
        alone = attn(s[:, start : start + 8], block_valid)
        torch.testing.assert_close(full[:, start : start + 8], alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(full[~valid], torch.zeros_like(full[~valid]))


def test_no_graph_breaks():
    """The compiler captures the whole model as one graph (no data-dependent Python control flow)."""
    model = GemRef(TINY)
    explanation = torch._dynamo.explain(model)(**tiny_batch(batch_size=4).features())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# -- gradients and training ----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, TINY_COMP_SKIP], ids=["tiny", "tiny_comp_skip"])
def test_every_parameter_gets_a_finite_gradient(cfg):
    model = GemRef(cfg)
    batch = with_edge_lengths(tiny_batch(cfg, batch_size=32, ctr_target=0.3, cvr_target=0.1))
    loss = masked_bce_loss(model(**batch.features()), batch.labels, batch.label_mask)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} is unused (dead code)"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


def test_training_lowers_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = GemRef(TINY)
    batch = tiny_batch(batch_size=32, ctr_target=0.3, cvr_target=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = masked_bce_loss(model(**batch.features()), batch.labels, batch.label_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


# -- loss ----------------------------------------------------------------------------------------------


def test_masked_bce_loss():
    logits = torch.tensor([[0.5, -1.0], [2.0, 3.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[mask], labels[mask], reduction="mean"
    )
    torch.testing.assert_close(masked_bce_loss(logits, labels, mask), expected)
    # Masked entries do not matter, even NaN-free garbage labels there.
    garbage = labels.clone()
    garbage[0, 1] = 1.0
    torch.testing.assert_close(masked_bce_loss(logits, garbage, mask), expected)
    # No valid label: 0, with zero (not NaN) gradients.
    none = masked_bce_loss(logits, labels, torch.zeros_like(mask))
    none.backward()
    assert none.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


# -- configs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(head_dim=8), "n_heads"),
        (dict(n_heads=3, head_dim=11, d=33), "head_dim"),
        (dict(group_size=3), "group_size"),
        (dict(block_size=0), "block_size"),
        (dict(n_layers=0), "n_layers"),
        (dict(d=0), "d"),
        (dict(table_rows=1), "table_rows"),
        (dict(item_vocab=1), "item_vocab"),
        (dict(seq_max_lens=()), "seq_max_lens"),
        (dict(seq_max_lens=(64, 0)), "seq_max_lens"),
        (dict(expert_mlp=(0,)), "expert_mlp"),
        (dict(top_mlp=(64, -1)), "top_mlp"),
        (dict(n_experts=0), "n_experts"),
        (dict(n_recent=-1), "n_recent"),
        (dict(n_time_buckets=0), "n_time_buckets"),
        (dict(ffn_mult=1.5), "ffn_mult"),
        (dict(comp_skip="yes"), "comp_skip"),
    ],
)
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **overrides)


def test_unknown_size_and_bad_cfg():
    with pytest.raises(ValueError, match="size"):
        gem_ref_config("huge")
    with pytest.raises(TypeError, match="cfg"):
        GemRef({"d": 32})


def test_data_config_matches_model():
    cfg = gem_ref_config("small")
    data_cfg = cfg.data_config(256, fill=0.3, length_dist="heavy_tail", seed=3, batch_shuffle=True)
    assert data_cfg.seq_max_lens == cfg.seq_max_lens == (1024, 256)
    assert (data_cfg.item_vocab, data_cfg.n_sparse_tables, data_cfg.table_rows) == (1 << 20, 32, 1 << 16)
    assert (data_cfg.max_hot, data_cfg.n_dense, data_cfg.n_domains, data_cfg.n_tasks) == (8, 64, 2, 2)
    assert (data_cfg.fill, data_cfg.length_dist, data_cfg.seed, data_cfg.batch_shuffle) == (
        0.3, "heavy_tail", 3, True
    )
    assert cfg.data_config(8, ctr_target=0.1).ctr_target == 0.1


def test_small_and_large_parameter_counts_on_meta():
    with torch.device("meta"):
        small = GemRef(gem_ref_config("small"))
        large = GemRef(gem_ref_config("large"))
    counts = small.parameter_counts()
    assert counts["sparse"] == 32 * (1 << 16) * 256 + (1 << 20) * 256
    assert 70e6 < counts["dense"] < 95e6  # gem_model.md 6.3: ~80M
    counts = large.parameter_counts()
    assert counts["sparse"] == 128 * (1 << 20) * 128 + (1 << 22) * 128
    assert 4.5e9 < counts["dense"] < 7e9  # ~5-6B, the Wukong experts dominate
    experts = sum(p.numel() for layer in large.layers for p in layer.interaction.parameters())
    assert experts > 0.8 * counts["dense"]
    # CompSkip in large: even layers GDPA + pooling, odd layers block self-attention with cached pooling.
    assert [layer.gdpa is not None for layer in large.layers] == [True, False] * 3
    assert [layer.self_attention is not None for layer in large.layers] == [False, True] * 3
    assert [layer.seq_summary is not None for layer in large.layers] == [True, False] * 3
    assert all(layer.gdpa is not None and layer.self_attention is not None for layer in small.layers)
    # Pyramid: layer 0 sees N_ns + |S_sum| tokens, later layers n_F + n_L + |S_sum|.
    cfg = gem_ref_config("large")
    assert large.layers[0].interaction.experts[0].lcb.in_features == 32 + 8 + 4 * (32 + 16)
    assert large.layers[1].interaction.experts[0].lcb.in_features == 64 + 64 + 4 * (32 + 16)
    assert cfg.n_nonseq_tokens == 40 and cfg.n_seq_summary_tokens == 192


def test_medium_fits_one_gpu_with_large_widths():
    # large's layer widths, parameters for one H200: ~2.3B in all, fp32 weights + Adam/Adagrad state ~35 GB
    with torch.device("meta"):
        medium = GemRef(gem_ref_config("medium"))
    counts = medium.parameter_counts()
    assert counts["sparse"] == 64 * (1 << 17) * 128 + (1 << 20) * 128
    assert 0.8e9 < counts["dense"] < 1.3e9
    cfg, large = gem_ref_config("medium"), gem_ref_config("large")
    assert (cfg.d, cfg.head_dim) == (large.d, large.head_dim) and cfg.seq_max_lens == (2048, 512)
