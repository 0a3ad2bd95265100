"""The jagged kernels' warp-specialized configs (common/warp_specialize.py: forward and dK/dV) on CUDA, one
config per kernel at a time, against the float64 reference: forward and backward; padded (B, H, L, D) and
(B, L, H, D) layouts with NaN in padded rows, packed tokens, causal; and one forward captured in a CUDA
graph (the descriptors' scratch is allocated inside the capture) replayed against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_jagged_attention_warp_specialize_gpu.py
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a Hopper (sm_90) or newer CUDA GPU", allow_module_level=True)

from kernel_checks import TOL, rel

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.common import ragged_tma, tuned_launch
from gemcompile.lowering.jagged_attention import packed_triton
from gemcompile.lowering.jagged_attention import triton as kernels
from gemcompile.lowering.jagged_attention.packed import packed_reference_forward
from gemcompile.lowering.jagged_attention.reference import reference_backward, reference_forward

DEV = "cuda"
FWD, DKDV = kernels._fwd_kernel, kernels._bwd_dkdv_kernel
WS = {FWD: kernels._FWD_WS_CONFIGS, DKDV: kernels._DKDV_WS_CONFIGS}
PAIRS = max(len(configs) for configs in WS.values())


def _label(i):
    return "-".join("{BLOCK_M}x{BLOCK_N}".format(**WS[k][i % len(WS[k])].kwargs) for k in (FWD, DKDV))


@pytest.fixture(params=range(PAIRS), ids=_label)
def ws_config(request, monkeypatch):
    """The forward and dK/dV each pinned to one WS config, TMA taken at every size (WS rides on it)."""
    for kernel, configs in WS.items():
        monkeypatch.setattr(kernel, "configs", [configs[request.param % len(configs)]])
        monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(tuned_launch, "_BEST_CONFIG", {})
    monkeypatch.setattr(ragged_tma, "TMA_MIN_WORK", 0)
    return request.param


def chose_ws(kernel=FWD) -> bool:
    return any(entry[1].kwargs.get("WS") for key, entry in tuned_launch._BEST_CONFIG.items() if key[0] is kernel)


def lengths(B, L, g):
    special = [0, 1, L, L - 1, (L // 2) | 1]
    rand = torch.randint(0, L + 1, (B,), generator=g)
    return torch.tensor([special[i] if i < len(special) else int(rand[i]) for i in range(B)])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_forward_and_backward_match_float64(ws_config, D, layout, causal):
    B, H, L = 7, 2, 777
    g = torch.Generator().manual_seed(D + causal)
    if layout == "bhld":
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    else:
        qkv = torch.randn(B, L, 3, H, D, generator=g).to(DEV, torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    lens = lengths(B, L, g).to(DEV)
    pad = (torch.arange(L, device=DEV)[None, :] >= lens[:, None])[:, None, :, None]
    for t in (q, k, v):  # NaN in padded rows: a descriptor reading past a sequence shows up
        t.masked_fill_(pad.expand_as(t), float("nan"))
    scale = 1 / math.sqrt(D)
    out, lse = kernels.jagged_attention_forward_triton(q, k, v, lens, lens, None, causal, scale)
    assert chose_ws()
    d64 = [t.double().nan_to_num(0.0) for t in (q, k, v)]
    ref_out, ref_lse = reference_forward(*d64, lens, lens, None, causal, scale)
    fwd_tol, bwd_tol = TOL[torch.bfloat16]
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite())
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-2
    grad = torch.randn(out.shape, generator=g).to(DEV, torch.bfloat16)
    dq, dk, dv, _ = kernels.jagged_attention_backward_triton(grad, q, k, v, out, lse, lens, lens, None, causal,
                                                             scale, False)
    assert chose_ws(DKDV)
    ref = reference_backward(grad.double(), *d64, ref_out, ref_lse, lens, lens, None, causal, scale, False)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))


@pytest.mark.parametrize("D", [64, 128])
def test_ws_forward_packed_tokens(ws_config, D):
    H, N = 2, 900
    lens = torch.tensor([0, 900, 1, 333, 640, 17])
    offsets = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(DEV)
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(int(lens.sum()), H, D, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    out, _ = packed_triton.jagged_attention_forward_triton(q, k, v, None, None, None, True, D ** -0.5,
                                                           token_offsets=offsets, packed_len=N)
    assert chose_ws()
    ref, _ = packed_reference_forward(q.double(), k.double(), v.double(), None, None, None, True, D ** -0.5,
                                      token_offsets=offsets, packed_len=N)
    assert rel(out, ref) < TOL[torch.bfloat16][0]


def test_ws_forward_in_a_cuda_graph(ws_config):
    B, H, L, D = 6, 4, 1024, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    lens = lengths(B, L, g).to(DEV)
    eager = kernels.jagged_attention_forward_triton(q, k, v, lens, lens, None, False, D ** -0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.jagged_attention_forward_triton(q, k, v, lens, lens, None, False, D ** -0.5)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
