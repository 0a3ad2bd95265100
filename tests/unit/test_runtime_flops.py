"""runtime/training/flops.py: the section-8 formula against FlopCounterMode, useful vs padded, peak table /
MFU."""

import math

import pytest
import torch

from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, GemRefConfig, gem_ref_config
from gemcompile.runtime.training.flops import (
    PEAK_BF16_DENSE_TFLOPS,
    GemFlopFormula,
    PaddedFlopCounter,
    block_attention_pairs,
    count_forward_flops,
    mfu,
    peak_flops,
)


@pytest.fixture(scope="module")
def tiny():
    cfg = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(cfg)
    return cfg, model, GemFlopFormula.from_model(model)


def _batch(cfg, batch_size=8, fill=0.5, step=0):
    return SyntheticData(cfg.data_config(batch_size, fill=fill)).batch(step)


@pytest.mark.parametrize("batch_size", [3, 8])
def test_padded_mode_equals_flop_counter_mode(tiny, batch_size):
    cfg, model, formula = tiny
    batch = _batch(cfg, batch_size)
    measured = count_forward_flops(model, batch.features())
    assert formula.forward_flops(None, batch_size, padded=True) == measured
    # Lengths do not change what the padded model executes.
    assert count_forward_flops(model, _batch(cfg, batch_size, fill=1.0).features()) == measured


def test_padded_mode_equals_flop_counter_mode_other_config():
    # CompSkip layers, three sequence types, no recent tokens, lengths not multiples of the block.
    cfg = GemRefConfig(
        n_layers=3,
        comp_skip=True,
        seq_max_lens=(40, 24, 7),
        n_recent=0,
        n_experts=3,
        block_size=8,
        n_pma=3,
        n_sum=5,
    )
    torch.manual_seed(0)
    model = GemRef(cfg)
    formula = GemFlopFormula.from_model(model)
    batch = _batch(cfg, 5)
    assert formula.forward_flops(None, 5, padded=True) == count_forward_flops(model, batch.features())
    # Every sequence type has its own per-token parameter group, and every layer's terms are found.
    assert all(n > 0 for n in formula.params_per_token())
    assert sum(t.kind == "block" for t in formula.attentions) == 3  # layer 1 only, one per sequence type
    assert sum(t.kind == "gdpa" for t in formula.attentions) == 3 * 2  # layers 0 and 2


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_padded_mode_equals_flop_counter_mode_on_meta(size):
    # The GPU presets (large: ~17B embedding parameters) built on the meta device: shapes only, no memory.
    cfg = gem_ref_config(size)
    with torch.device("meta"):
        model = GemRef(cfg)
    formula = GemFlopFormula.from_model(model)
    b = 2
    meta = {"device": "meta"}
    inputs = {
        "sparse_ids": torch.zeros(b, cfg.n_tables, cfg.max_hot, dtype=torch.int64, **meta),
        "dense": torch.zeros(b, cfg.n_dense, **meta),
        "seq_items": [torch.zeros(b, n, dtype=torch.int64, **meta) for n in cfg.seq_max_lens],
        "seq_actions": [torch.zeros(b, n, dtype=torch.int64, **meta) for n in cfg.seq_max_lens],
        "seq_times": [torch.zeros(b, n, **meta) for n in cfg.seq_max_lens],
        "seq_lengths": [torch.zeros(b, dtype=torch.int64, **meta) for _ in cfg.seq_max_lens],
        "domain": torch.zeros(b, dtype=torch.int64, **meta),
    }
    assert formula.forward_flops(None, b, padded=True) == count_forward_flops(model, inputs)
    # CompSkip (large): block attention only on odd layers, GDPA only on even ones.
    n_sa_layers = sum(cfg.layer_runs_self_attention(i) for i in range(cfg.n_layers))
    assert sum(t.kind == "block" for t in formula.attentions) == n_sa_layers * cfg.n_seq


def test_padded_counter_caches_per_shape(tiny):
    cfg, model, _ = tiny
    counter = PaddedFlopCounter(model)
    calls = []
    original = counter.model
    counter.model = lambda **kw: (calls.append(1), original(**kw))[1]
    small, big = _batch(cfg, 4), _batch(cfg, 6)
    first = counter.forward_flops(small.features())
    assert counter.forward_flops(_batch(cfg, 4, step=3).features()) == first
    assert len(calls) == 1
    assert counter.forward_flops(big.features()) > first and len(calls) == 2
    assert counter.train_flops(big.features()) == 3 * counter.forward_flops(big.features())


def test_useful_at_most_padded_and_full_lengths_differ_by_block_attention_only(tiny):
    cfg, _, formula = tiny
    for fill in (0.1, 0.5, 0.9):
        batch = _batch(cfg, 8, fill=fill)
        assert formula.forward_flops(batch.seq_lengths, 8) < formula.forward_flops(None, 8, padded=True)
    full = _batch(cfg, 8, fill=1.0)
    assert all(bool((n == cfg.seq_max_lens[k]).all()) for k, n in enumerate(full.seq_lengths))
    useful = formula.breakdown(full.seq_lengths, 8)
    padded = formula.breakdown(None, 8, padded=True)
    # Every term is equal at full lengths except block attention: useful counts sum_j b_j^2 = N * block
    # (valid pairs), the padded model computes the dense N x N masked attention.
    assert {k: v for k, v in useful.items() if k != "attention.block"} == {
        k: v for k, v in padded.items() if k != "attention.block"
    }
    per_pair = 2 * cfg.n_heads * (2 * cfg.head_dim)
    layers = cfg.n_layers
    expected_gap = sum(layers * per_pair * 8 * (n * n - n * cfg.block_size) for n in cfg.seq_max_lens)
    assert padded["attention.block"] - useful["attention.block"] == expected_gap
    assert formula.train_flops(full.seq_lengths, 8) == 3 * formula.forward_flops(full.seq_lengths, 8)


def test_block_term_hand_checked():
    # Lengths 0, 5, 16, 37 with blocks of 16: pairs 0, 25, 256, 16^2 + 16^2 + 5^2.
    lengths = torch.tensor([0, 5, 16, 37])
    assert block_attention_pairs(lengths, 16).tolist() == [0, 25, 256, 537]
    assert block_attention_pairs(37, 16) == 537
    cfg = GemRefConfig(n_layers=1, seq_max_lens=(48,), block_size=16)
    torch.manual_seed(0)
    formula = GemFlopFormula.from_model(GemRef(cfg))
    breakdown = formula.breakdown([lengths], 4)
    per_pair = 2 * cfg.n_heads * (cfg.head_dim + cfg.head_dim)  # QK^T and AV, 2 FLOPs per MAC
    assert breakdown["attention.block"] == per_pair * (0 + 25 + 256 + 537)
    # PMA (n_pma x n) in the layer and the final summary, GDPA (n x n_sum) in the layer.
    tokens = 0 + 5 + 16 + 37
    assert breakdown["attention.pma"] == 2 * per_pair * cfg.n_pma * tokens
    assert breakdown["attention.gdpa"] == per_pair * cfg.n_sum * tokens
    # Per-token linears: the input projection, PMA k/v (x2), GDPA q/out, SA q/k/v/out, FFN up/down.
    d = cfg.d
    per_token = cfg.d_item * d + 2 * 2 * d * d + 2 * d * d + 4 * d * d + 2 * cfg.ffn_mult * d * d
    assert formula.params_per_token() == (per_token,)
    assert breakdown["linear.token.0"] == 2 * per_token * tokens


def test_parameter_groups_cover_every_linear(tiny):
    _, model, formula = tiny
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sum(t.params for t in formula.matmuls) == linear_params  # each Linear runs exactly once
    scopes = {t.name: t.scope for t in formula.matmuls}
    assert scopes["heads.top.0"] == "sample"
    assert scopes["seq_embedding.proj.1"] == "token"
    assert scopes["layers.0.seq_summary.pma.0.q_proj"] == "step"  # learned queries: batch-independent
    assert scopes["layers.0.gdpa.0.k_proj"] == "sample"  # keys come from X_sum (n_sum rows per sample)


def test_breakdown_rejects_bad_arguments(tiny):
    _, _, formula = tiny
    with pytest.raises(ValueError, match="batch_size"):
        formula.breakdown(None, 0, padded=True)
    with pytest.raises(ValueError, match=f"seq_lengths must hold {formula.n_seq}"):
        formula.breakdown([torch.zeros(4, dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match=r"seq_lengths\[0\] has 3 entries"):
        formula.breakdown([torch.zeros(3, dtype=torch.int64)] * 2, 4)


def test_peak_table_and_mfu():
    assert PEAK_BF16_DENSE_TFLOPS["H100"] == PEAK_BF16_DENSE_TFLOPS["H200"] == 989
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA B200") == 2250e12
    assert peak_flops("cpu") is None and peak_flops(torch.device("cpu")) is None
    assert peak_flops("Some Future GPU") is None
    assert mfu(494.5e12, "NVIDIA H200") == pytest.approx(0.5)
    assert mfu(1e12, "cpu") is None
    if not torch.cuda.is_available():
        assert mfu(1e12, "cuda") is None
    assert math.isclose(mfu(312e12 / 4, "A100"), 0.25)
