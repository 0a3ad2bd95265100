"""runtime/training/metrics.py: NE against a hand computation, AUC against brute-force pair counting."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemcompile.runtime.training.metrics import MetricWindow, auc, normalized_entropy


def _brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_ne_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.0, -3.0])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    probs = [1 / (1 + math.exp(-z)) for z in logits.tolist()]
    bce = -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(probs, labels.tolist())) / 4
    base = -(0.5 * math.log(0.5) * 2)
    assert normalized_entropy(logits, labels) == pytest.approx(bce / base, rel=1e-12)


def test_ne_uses_only_masked_labels():
    logits = torch.tensor([2.0, -1.0, 5.0, -3.0, 9.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([True, True, False, True, False])
    expected = normalized_entropy(logits[mask], labels[mask])
    assert normalized_entropy(logits, labels, mask) == expected
    # Base rate 1/3 over the three valid labels.
    p = 1 / 3
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    probs = torch.sigmoid(logits[mask].double())
    bce = -(torch.log(probs[0]) + torch.log(1 - probs[1]) + torch.log(1 - probs[2])) / 3
    assert expected == pytest.approx(float(bce) / base, rel=1e-12)


def test_ne_of_base_rate_predictor_is_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logit = math.log(0.25 / 0.75)
    assert normalized_entropy(torch.full((4,), logit), labels) == pytest.approx(1.0, rel=1e-12)


def test_ne_undefined_is_nan():
    assert math.isnan(normalized_entropy(torch.zeros(3), torch.zeros(3)))
    assert math.isnan(normalized_entropy(torch.zeros(3), torch.ones(3)))
    assert math.isnan(normalized_entropy(torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.bool)))


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=2, max_size=40))
def test_auc_matches_brute_force_with_ties(data):
    # Small integer scores make ties frequent.
    scores = [float(s) for s, _ in data]
    labels = [1.0 if y else 0.0 for _, y in data]
    result = auc(torch.tensor(scores), torch.tensor(labels))
    if all(labels) or not any(labels):
        assert math.isnan(result)
    else:
        assert result == pytest.approx(_brute_force_auc(scores, labels), abs=1e-12)


def test_auc_random_continuous_and_masked():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(300, generator=gen)
    labels = (torch.rand(300, generator=gen) < 0.3).float()
    mask = torch.rand(300, generator=gen) < 0.7
    expected = _brute_force_auc(scores[mask].tolist(), labels[mask].tolist())
    assert auc(scores, labels, mask) == pytest.approx(expected, abs=1e-12)


def test_auc_perfect_inverted_and_all_tied():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.zeros(4), labels) == 0.5


def test_auc_one_class_is_nan():
    assert math.isnan(auc(torch.randn(5), torch.zeros(5)))
    assert math.isnan(auc(torch.randn(5), torch.ones(5)))


def test_metric_window_per_task_and_eviction():
    window = MetricWindow(n_tasks=2, window=2)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(3):
        logits = torch.randn(16, 2, generator=gen)
        labels = (torch.rand(16, 2, generator=gen) < 0.5).float()
        mask = torch.rand(16, 2, generator=gen) < 0.8
        steps.append((logits, labels, mask))
        window.update(logits, labels, mask)
    assert len(window) == 2
    result = window.compute()
    logits = torch.cat([s[0] for s in steps[1:]])
    labels = torch.cat([s[1] for s in steps[1:]])
    mask = torch.cat([s[2] for s in steps[1:]])
    for task in range(2):
        assert result.ne[task] == normalized_entropy(logits[:, task], labels[:, task], mask[:, task])
        assert result.auc[task] == auc(logits[:, task], labels[:, task], mask[:, task])
        assert result.n_labels[task] == int(mask[:, task].sum())


def test_metric_window_one_class_task_and_round_trip():
    window = MetricWindow(n_tasks=2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    window.update(torch.randn(3, 2), labels, torch.ones(3, 2, dtype=torch.bool))
    result = window.compute()
    assert not math.isnan(result.auc[0]) and math.isnan(result.auc[1]) and math.isnan(result.ne[1])
    restored = MetricWindow(n_tasks=2)
    restored.load_bytes(window.to_bytes())
    assert restored.compute().ne[0] == result.ne[0]


def test_metric_window_empty_and_bad_shapes():
    window = MetricWindow(n_tasks=2, window=4)
    assert all(math.isnan(v) for v in window.compute().ne)
    with pytest.raises(ValueError, match=r"logits must be \(B, 2\)"):
        window.update(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window must be"):
        MetricWindow(n_tasks=2, window=0)
