"""Synthetic GEM data: determinism, length distributions, layouts, labels, batch shuffling, validation."""
import dataclasses
import hashlib
import subprocess
import sys

import pytest
import torch

from gemcompile.models.data import (
    SHUFFLE_WINDOW,
    DataConfig,
    GemBatch,
    SyntheticData,
    lognormal_mean_fill,
    solve_lognormal_mu,
)

BASE = dict(
    batch_size=64,
    seq_max_lens=(64, 32),
    item_vocab=1000,
    n_actions=3,
    n_sparse_tables=4,
    table_rows=1000,
    max_hot=4,
    n_dense=8,
    n_domains=2,
)


def make_cfg(**overrides) -> DataConfig:
    return DataConfig(**{**BASE, **overrides})


def assert_batches_equal(a: GemBatch, b: GemBatch) -> None:
    for f in dataclasses.fields(GemBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, list):
            assert len(x) == len(y)
            for xi, yi in zip(x, y):
                assert xi.dtype == yi.dtype and torch.equal(xi, yi), f.name
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), f.name


def batch_digest(batch: GemBatch) -> str:
    h = hashlib.sha256()
    for f in dataclasses.fields(GemBatch):
        value = getattr(batch, f.name)
        for t in value if isinstance(value, list) else [value]:
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


# -- determinism ---------------------------------------------------------------------------------------


def test_same_step_is_bit_identical_and_independent_of_history():
    cfg = make_cfg(length_dist="heavy_tail")
    first = SyntheticData(cfg)
    for step in range(21):
        first.batch(step)
    resumed = SyntheticData(cfg).batch(21)
    assert_batches_equal(first.batch(21), resumed)
    assert batch_digest(first.batch(20)) != batch_digest(resumed)
    other_seed = SyntheticData(make_cfg(length_dist="heavy_tail", seed=1)).batch(21)
    assert batch_digest(other_seed) != batch_digest(resumed)


def test_same_step_is_bit_identical_in_another_process():
    """Another process with another intra-op thread count draws the same bits."""
    cfg = make_cfg(length_dist="heavy_tail", batch_size=32)
    code = (
        "import torch, sys; torch.set_num_threads(1); sys.path.insert(0, 'tests/unit');"
        "from test_data import make_cfg, batch_digest; from gemcompile.models.data import SyntheticData;"
        "print(batch_digest(SyntheticData(make_cfg(length_dist='heavy_tail', batch_size=32)).batch(5)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert out.stdout.strip() == batch_digest(SyntheticData(cfg).batch(5))
    finally:
        torch.set_num_threads(threads)


# -- lengths -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [0.3, 0.5, 0.7])
def test_lognormal_mu_solves_fill_exactly(fill):
    for n_max in (1, 7, 64, 1024):
        mu = solve_lognormal_mu(fill, 1.0, n_max)
        assert abs(lognormal_mean_fill(mu, 1.0, n_max) - fill) < 1e-6


@pytest.mark.parametrize("length_dist", ["uniform", "heavy_tail"])
@pytest.mark.parametrize("fill", [0.3, 0.5, 0.7])
def test_mean_fill_matches_target(length_dist, fill):
    cfg = make_cfg(batch_size=4096, fill=fill, length_dist=length_dist)
    batch = SyntheticData(cfg).batch(0)
    for n_max, lengths in zip(cfg.seq_max_lens, batch.seq_lengths):
        assert lengths.dtype == torch.int64 and lengths.shape == (cfg.batch_size,)
        assert int(lengths.min()) >= 0 and int(lengths.max()) <= n_max
        achieved = lengths.double().mean().item() / n_max
        assert abs(achieved - fill) < 0.02, (n_max, achieved)
    assert abs(batch.padding_efficiency() - fill) < 0.02


def test_heavy_tail_has_empty_and_full_sequences_and_correlated_types():
    cfg = make_cfg(batch_size=4096, fill=0.3, length_dist="heavy_tail")
    lengths = SyntheticData(cfg).batch(0).seq_lengths
    for n_max, length in zip(cfg.seq_max_lens, lengths):
        assert int((length == 0).sum()) > 0
        assert int((length == n_max).sum()) > 0
    # Shared user-activity factor: one user's sequence types are positively correlated.
    logs = torch.stack([torch.log1p(length.double()) for length in lengths])
    assert torch.corrcoef(logs)[0, 1] > 0.3


def test_uniform_fill_one_is_all_full():
    cfg = make_cfg(batch_size=32, fill=1.0)
    for n_max, length in zip(cfg.seq_max_lens, SyntheticData(cfg).batch(0).seq_lengths):
        assert torch.all(length == n_max)


# -- layout --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length_dist", ["uniform", "heavy_tail"])
def test_padded_layout_values(length_dist):
    cfg = make_cfg(batch_size=512, fill=0.3, length_dist=length_dist)
    batch = SyntheticData(cfg).batch(3)
    b = cfg.batch_size
    for n_max, items, actions, times, lengths in zip(
        cfg.seq_max_lens, batch.seq_items, batch.seq_actions, batch.seq_times, batch.seq_lengths
    ):
        assert items.shape == actions.shape == times.shape == (b, n_max)
        assert items.dtype == actions.dtype == torch.int64 and times.dtype == torch.float32
        valid = torch.arange(n_max)[None, :] < lengths[:, None]
        for padded in (items, actions, times):
            assert torch.all(padded[~valid] == 0)
        assert torch.all(items[valid] >= 1) and torch.all(items[valid] < cfg.item_vocab)
        assert torch.all(actions[valid] >= 0) and torch.all(actions[valid] < cfg.n_actions)
        assert torch.all(times[valid] > 0)
        # Oldest first: ages never increase along the valid part of a sequence.
        both_valid = valid[:, 1:] & valid[:, :-1]
        assert torch.all((times[:, 1:] <= times[:, :-1])[both_valid])
        # Ages span seconds to days.
        assert times[valid].min() < 3600 and times[valid].max() > 86400
    # Skewed actions: impression >> click >> conversion.
    valid_actions = torch.cat([a[torch.arange(a.shape[1])[None] < n[:, None]] for a, n in
                               zip(batch.seq_actions, batch.seq_lengths)])
    counts = torch.bincount(valid_actions, minlength=3)
    assert counts[0] > 5 * counts[1] > 5 * counts[2] > 0


def test_item_ids_are_zipf_and_permuted():
    cfg = make_cfg(batch_size=1024, fill=1.0)
    items = torch.cat([s.flatten() for s in SyntheticData(cfg).batch(0).seq_items])
    counts = torch.bincount(items, minlength=cfg.item_vocab)
    top = torch.sort(counts, descending=True)
    # Zipf(1.1) over 999 ids: the top id is ~20% of the draws and ~2^1.1 times the second one.
    assert 0.12 < top.values[0] / items.numel() < 0.3
    assert 1.6 < top.values[0] / top.values[1] < 2.8
    # The popular ids are scattered over the vocabulary, not 1, 2, 3, ...
    assert set(top.indices[:5].tolist()) != {1, 2, 3, 4, 5}


def test_sparse_ids_and_dense():
    cfg = make_cfg(batch_size=2048, max_hot=8)
    batch = SyntheticData(cfg).batch(1)
    ids = batch.sparse_ids
    assert ids.shape == (cfg.batch_size, cfg.n_sparse_tables, cfg.max_hot) and ids.dtype == torch.int64
    used = ids > 0
    pooling = used.sum(-1)
    assert pooling.min() >= 1 and pooling.max() <= cfg.max_hot
    assert 3.0 < pooling.double().mean() < 5.0  # clipped Normal(max_hot / 2, max_hot / 4)
    # Used slots come first, then zeros.
    assert torch.equal(used, torch.arange(cfg.max_hot)[None, None, :] < pooling[..., None])
    assert ids.max() < cfg.table_rows
    # Tables differ (each rotates the shared permutation).
    assert not torch.equal(torch.mode(ids[:, 0, 0]).values, torch.mode(ids[:, 1, 0]).values)
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (cfg.batch_size, cfg.n_dense)
    assert abs(batch.dense.mean()) < 0.05 and abs(batch.dense.std() - 1) < 0.05
    assert batch.domain.dtype == torch.int64
    assert set(batch.domain.unique().tolist()) == {0, 1}


def test_jagged_agrees_with_padded():
    cfg = make_cfg(batch_size=37, length_dist="heavy_tail", fill=0.3)
    batch = SyntheticData(cfg).batch(2)
    for k in range(len(cfg.seq_max_lens)):
        values, offsets = batch.jagged(k)
        lengths = batch.seq_lengths[k]
        assert offsets.shape == (cfg.batch_size + 1,) and offsets[0] == 0
        assert torch.equal(offsets.diff(), lengths)
        for name, padded in (("items", batch.seq_items[k]), ("actions", batch.seq_actions[k]),
                             ("times", batch.seq_times[k])):
            assert values[name].shape == (int(lengths.sum()),)
            for i in range(cfg.batch_size):
                assert torch.equal(values[name][offsets[i] : offsets[i + 1]], padded[i, : lengths[i]])
    with pytest.raises(ValueError, match="k"):
        batch.jagged(2)


def test_features_to_and_padding_efficiency():
    cfg = make_cfg(batch_size=16)
    batch = SyntheticData(cfg).batch(0)
    assert set(batch.features()) == {
        "sparse_ids", "dense", "seq_items", "seq_actions", "seq_times", "seq_lengths", "domain"
    }
    assert_batches_equal(batch.to("cpu"), batch)
    expected = sum(int(n.sum()) for n in batch.seq_lengths) / (16 * (64 + 32))
    assert batch.padding_efficiency() == pytest.approx(expected)


# -- labels --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctr, cvr", [(0.02, 0.005), (0.1, 0.03)])
def test_label_rates_match_targets(ctr, cvr):
    cfg = make_cfg(batch_size=20000, seq_max_lens=(32, 16), ctr_target=ctr, cvr_target=cvr)
    data = SyntheticData(cfg)
    batch = GemBatch.concat([data.batch(0), data.batch(1)])
    labels, mask = batch.labels, batch.label_mask
    assert labels.shape == mask.shape == (2 * cfg.batch_size, 2)
    assert labels.dtype == torch.float32 and mask.dtype == torch.bool
    assert abs(labels[:, 0].mean().item() - ctr) < 0.2 * ctr
    assert abs(labels[:, 1].mean().item() - cvr) < 0.3 * cvr
    assert torch.all(labels[:, 1] <= labels[:, 0])  # conversions only follow clicks
    assert torch.all(mask[:, 0])
    assert abs(mask[:, 1].float().mean().item() - 0.9) < 0.02


def test_labels_depend_on_features():
    """Clicks are a function of the features: under independence n * sum_j corr(dense_j, click)^2 would
    be chi-square with 8 degrees of freedom (99.99th percentile ~32)."""
    cfg = make_cfg(batch_size=20000, seq_max_lens=(32, 16), ctr_target=0.2, cvr_target=0.05)
    batch = SyntheticData(cfg).batch(0)
    clicks = batch.labels[:, 0]
    corr = torch.stack([torch.corrcoef(torch.stack([batch.dense[:, j], clicks]))[0, 1] for j in range(8)])
    assert cfg.batch_size * (corr**2).sum() > 100


def test_single_task():
    batch = SyntheticData(make_cfg(batch_size=8, n_tasks=1)).batch(0)
    assert batch.labels.shape == batch.label_mask.shape == (8, 1)


# -- Base Batch Shuffling ------------------------------------------------------------------------------


def sample_keys(batches: list[GemBatch]) -> list[tuple]:
    keys = []
    for batch in batches:
        for i in range(batch.batch_size):
            keys.append((
                tuple(int(n[i]) for n in batch.seq_lengths),
                tuple(int(s[i].sum()) for s in batch.seq_items),
                batch.dense[i].sum().item(),
                batch.sparse_ids[i].sum().item(),
                tuple(batch.labels[i].tolist()),
            ))
    return sorted(keys)


def test_batch_shuffle_keeps_samples_and_evens_out_totals():
    plain = SyntheticData(make_cfg(length_dist="heavy_tail", fill=0.3))
    shuffled_cfg = make_cfg(length_dist="heavy_tail", fill=0.3, batch_shuffle=True)
    shuffled = SyntheticData(shuffled_cfg)
    for window in range(2):
        steps = range(window * SHUFFLE_WINDOW, (window + 1) * SHUFFLE_WINDOW)
        raw = [plain.batch(s) for s in steps]
        mixed = [shuffled.batch(s) for s in steps]
        assert all(b.batch_size == 64 for b in mixed)
        assert sample_keys(raw) == sample_keys(mixed)
        raw_totals = torch.stack([b.total_lengths().sum() for b in raw]).double()
        mixed_totals = torch.stack([b.total_lengths().sum() for b in mixed]).double()
        assert mixed_totals.sum() == raw_totals.sum()
        assert mixed_totals.std() < 0.5 * raw_totals.std()
    # Still reproducible per step, from a fresh instance.
    assert_batches_equal(SyntheticData(shuffled_cfg).batch(11), shuffled.batch(11))


# -- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(fill=0.0), "fill"),
        (dict(fill=1.5), "fill"),
        (dict(fill=-0.1), "fill"),
        (dict(seq_max_lens=(64, 0)), "seq_max_lens"),
        (dict(seq_max_lens=()), "seq_max_lens"),
        (dict(seq_max_lens=5), "seq_max_lens"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=2.5), "batch_size"),
        (dict(length_dist="pareto"), "length_dist"),
        (dict(item_vocab=1), "item_vocab"),
        (dict(n_actions=0), "n_actions"),
        (dict(n_sparse_tables=0), "n_sparse_tables"),
        (dict(table_rows=1), "table_rows"),
        (dict(max_hot=0), "max_hot"),
        (dict(n_dense=0), "n_dense"),
        (dict(n_domains=0), "n_domains"),
        (dict(n_tasks=3), "n_tasks"),
        (dict(seed=-1), "seed"),
        (dict(ctr_target=0.0), "ctr_target"),
        (dict(ctr_target=1.0), "ctr_target"),
        (dict(cvr_target=0.03), "cvr_target"),
        (dict(cvr_target=0.0), "cvr_target"),
        (dict(batch_shuffle="yes"), "batch_shuffle"),
    ],
)
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_cfg(**overrides)


def test_list_seq_max_lens_becomes_tuple_and_bad_step():
    cfg = make_cfg(seq_max_lens=[8, 4])
    assert cfg.seq_max_lens == (8, 4)
    with pytest.raises(ValueError, match="step"):
        SyntheticData(cfg).batch(-1)
    with pytest.raises(TypeError, match="cfg"):
        SyntheticData(BASE)
