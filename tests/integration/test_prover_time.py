"""The mask prover answers in seconds on real masks it cannot classify: generative-recommenders' HSTU mask
with a contextual prefix and targets (ops/pytorch/pt_hstu_attention.py, _get_valid_attn_mask) once made the
conjunctive normal form of its formula take minutes (classify._clauses)."""

import functools
import signal

import pytest
import torch
import torch.nn.functional as F

from gemcompile import explain

L, H, D, CONTEXT = 16, 2, 16, 3


def _valid_attn_mask(n, seq_lengths, num_targets, contextual_seq_len, max_attn_len=0):
    # the upstream helper's ops, in its order
    ids = torch.arange(0, n).view(1, n)
    max_ids = seq_lengths.view(-1, 1, 1)
    ids = torch.clamp(ids - contextual_seq_len + 1, min=0)
    max_ids = max_ids - contextual_seq_len + 1
    max_ids = max_ids - num_targets.view(-1, 1, 1)
    ids = torch.clamp(ids, max=max_ids)
    row_ids = ids.view(-1, n, 1).expand(-1, n, n)
    col_ids = ids.view(-1, 1, n).expand(-1, n, n)
    valid = torch.logical_or(torch.eye(n, dtype=torch.bool).view(1, n, n), row_ids - col_ids > 0)
    if max_attn_len > 0:
        valid = torch.logical_and(valid, row_ids - col_ids <= max_attn_len)
    return torch.logical_or(valid, torch.logical_and(row_ids == 0, col_ids < max_ids))


def _hstu(q, k, v, lengths, targets, window=0):
    keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, :, None]
    q, k, v = q * keep, k * keep, v * keep
    a = F.silu(torch.einsum("bhxa,bhya->bhxy", q, k) * 0.25) / L
    mask = _valid_attn_mask(L, lengths, targets, CONTEXT, window)
    return torch.einsum("bhxd,bhdv->bhxv", a * mask.unsqueeze(1), v) * keep


def _on_alarm(*_):
    raise TimeoutError("the mask prover took over 90 s")


@pytest.mark.parametrize("window", [0, 2])
def test_a_mask_with_a_large_normal_form_is_answered_quickly(window):
    """With a window besides (max_attn_len), sympy's SAT once took over 10 minutes on the candidates HSTU's
    search adds (windows, the target count assumed >= 0): those are tried by the truth table only."""
    q, k, v = (torch.randn(4, H, L, D) for _ in range(3))
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(90)  # minutes before the bound on the normal form; seconds after
    try:
        report = explain(functools.partial(_hstu, window=window), q, k, v, torch.tensor([16, 1, 7, 11]),
                         torch.tensor([2, 0, 3, 1]))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert report.counts.get("gdpa", 0) + len(report.refusals) >= 1  # rewritten or refused with a reason
