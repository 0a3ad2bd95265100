"""Compile-time accounting: every gemcompile pass's wall time lands in PASS_SECONDS, and the e2e benchmark's
compile_phases_since reports what a compile added (torch's phases and our passes), nothing else."""

import torch
import torch.nn.functional as F

from gemcompile import gem_compile
from gemcompile.passes.base import PASS_SECONDS
from gemcompile.runtime.training.step_timing import compile_phase_seconds, compile_phases_since


def _padded_attention(q, k, v, lengths):
    keep = torch.arange(q.shape[-2])[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def test_a_compile_adds_its_passes_and_phases():
    torch._dynamo.reset()
    before = compile_phase_seconds()
    q = torch.randn(2, 2, 8, 16)
    gem_compile(_padded_attention)(q, q, q, torch.tensor([3, 8]))
    added = compile_phases_since(before, at_least_s=0.0)
    passes = added["gemcompile_passes_s"]
    # the attention rewrite ran on this graph, and each reported pass is a pass that exists
    assert passes["attention"] > 0, passes
    assert set(passes) <= set(PASS_SECONDS) and all(v >= 0 for v in passes.values())
    assert list(passes.values()) == sorted(passes.values(), reverse=True)  # largest first
    assert added["torch_s"].get("_compile.compile_inner", 0) > 0, added["torch_s"]


def test_nothing_compiled_adds_nothing():
    before = compile_phase_seconds()
    _padded_attention(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16),
                      torch.tensor([2]))
    assert compile_phases_since(before) == {"torch_s": {}, "gemcompile_passes_s": {}}
