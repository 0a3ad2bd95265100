"""gem_compile on GEM-ref tiny: the same outputs and gradients as eager (CPU, float32), with its PMA
attention rewritten to the jagged kernel, its GDPA cross-attention to the GDPA kernel, its block
self-attention to the block-attention kernel with RoPE fused, each sequence's token-wise layers run on
packed tokens (unpad), and no recompiles across 20 batches of different lengths."""

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

from gemcompile import gem_compile
from gemcompile.backend import GemBackend
from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import (
    PMA,
    BlockSelfAttention,
    GDPACrossAttention,
    GemRef,
    gem_ref_config,
    masked_bce_loss,
)
from gemcompile.passes.records import PassLog, recording


@pytest.mark.core  # kept in CI's fast tier (tests/slow_tier.py)
def test_gem_ref_tiny_compiled_matches_eager(monkeypatch):
    compiles = []
    original = GemBackend.__call__
    monkeypatch.setattr(GemBackend, "__call__", lambda self, *a, **kw: compiles.append(1) or original(self, *a, **kw))
    config = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(config)
    data = SyntheticData(config.data_config(batch_size=64, length_dist="heavy_tail", fill=0.3))
    counters.clear()
    log = PassLog()
    compiled = gem_compile(model)
    for step in range(20):  # different lengths every step (zero and full lengths among them)
        batch = data.batch(step)
        lengths = torch.cat(batch.seq_lengths)
        assert step > 0 or (lengths == 0).any()
        with recording(log) if step == 0 else contextlib.nullcontext():  # the compile's pass reports
            out = compiled(**batch.features())
        grads = torch.autograd.grad(masked_bce_loss(out, batch.labels, batch.label_mask), list(model.parameters()))
        ref = model(**batch.features())
        ref_grads = torch.autograd.grad(masked_bce_loss(ref, batch.labels, batch.label_mask),
                                        list(model.parameters()))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for (name, _), g, g_ref in zip(model.named_parameters(), grads, ref_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert len(compiles) == 1
    n_pma = sum(isinstance(m, PMA) for m in model.modules())  # one SDPA over a padded history each
    assert n_pma >= 2 and counters["gemcompile"]["jagged_attention"] == n_pma
    n_gdpa = sum(isinstance(m, GDPACrossAttention) for m in model.modules())
    assert n_gdpa >= 2 and counters["gemcompile"]["gdpa"] == n_gdpa
    n_block = sum(isinstance(m, BlockSelfAttention) for m in model.modules())  # one block-masked SDPA each
    assert n_block >= 2 and counters["gemcompile"]["block_attention"] == n_block
    block_rewrites = [r for r in log.rewrites if r.pass_name == "block_attention"]
    assert len(block_rewrites) == n_block
    for r in block_rewrites:
        assert f"block={config.block_size} window=-1 causal=False; rotary half fused" in r.detail, r.detail
    # one packed region per sequence type: embeddings, every layer's projections, norms and FFN
    unpad = [r for r in log.rewrites if r.pass_name == "unpad"]
    assert len(unpad) == config.n_seq == counters["gemcompile"]["unpad"]
    assert sorted(r.metrics["seq"] for r in unpad) == sorted(config.seq_max_lens)
    for r in unpad:
        assert r.metrics["gemms"] >= 1 + config.n_layers * 4, r.detail  # input proj + per layer q/out/up/down


def test_a_layer_compiled_alone_is_rewritten_like_in_the_whole_model():
    """Per-unit compile (the parallel plan's FSDP units, local MFU per layer) hands the compiler one
    GemLayer with lengths as inputs: it builds its masks itself, so the attention passes still prove them
    and rewrite every attention of the layer, as they do in the whole model."""
    from gemcompile import explain

    config = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(config)
    batch = SyntheticData(config.data_config(batch_size=8, fill=0.5)).batch(0)
    captured = []
    layer = model.layers[0]
    handle = layer.register_forward_pre_hook(lambda _m, args: captured.append(args))
    with torch.no_grad():
        model(**batch.features())
    handle.remove()
    report = explain(layer, *captured[0])
    n_seq = config.n_seq
    assert report.counts["jagged_attention"] == n_seq  # the PMA of the layer's sequence summary
    assert report.counts["gdpa"] == n_seq and report.counts["block_attention"] == n_seq
    assert not [r for r in report.refusals if r.pass_name in ("jagged_attention", "gdpa", "block_attention")]
