"""The autotuners' shared-memory fit (jagged_attention_triton._fit_shared_memory): fewer pipeline stages when
the tiles would not fit a Hopper block, checked against what Triton asked for on the H200."""

import pytest
import torch
import triton

from gemcompile.lowering.jagged_attention_triton import SHARED_MEMORY_BUDGET, _fit_shared_memory, _shared_memory


def _fitted_stages(kind, m, n, stages, head_d, dtype, bias_dtype=None):
    config = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=stages)
    args = {"Q": torch.empty(0, dtype=dtype), "HEAD_D": head_d, "HAS_BIAS": bias_dtype is not None,
            "Bias": torch.empty(0, dtype=bias_dtype or dtype)}
    return _fit_shared_memory(config, kind, args).num_stages


@pytest.mark.parametrize("kind, m, n, stages, refused_bytes", [
    ("fwd", 128, 64, 3, 256 * 1024),  # fp32, D=128: refused by Triton on the H200
    ("dq", 64, 64, 2, 256 * 1024),
])
def test_estimate_covers_what_triton_refused(kind, m, n, stages, refused_bytes):
    assert _shared_memory(kind, m, n, stages, 128, 4) >= refused_bytes > SHARED_MEMORY_BUDGET


def test_fp32_bias_tile_counts():
    # GDPA's dK/dV at 32x64, D=128, fp32 with an fp32 bias: Triton asked for 240 KiB at 2 stages
    assert _shared_memory("dkdv", 32, 64, 2, 128, 4, bias_size=4) > 240 * 1024 - 1
    assert _fitted_stages("dkdv", 32, 64, 3, 128, torch.float32, torch.float32) == 1
    assert _fitted_stages("dkdv", 32, 64, 3, 128, torch.float32) == 1


@pytest.mark.parametrize("kind, m, n", [("fwd", 128, 64), ("dkdv", 32, 128), ("dq", 128, 32)])
def test_bf16_configs_keep_their_stages(kind, m, n):
    # the 16-bit autotune configs ran on the H200 with 3 stages at D=64: the fit must not cut them
    assert _fitted_stages(kind, m, n, 3, 64, torch.bfloat16, torch.bfloat16) == 3
