"""The jagged kernels' warp-specialized variants (WS configs, common/warp_specialize.py), forward and dK/dV, run
by the Triton interpreter on CPU: one masked loop (over key tiles, over query tiles) whose tiles come through
descriptors made in the kernel over each sequence's rows.

The interpreter runs the loops without specializing them, so these tests check what the variants compute: the
same output, lse and gradients, bit for bit, as the TMA configs they ride on (one masked loop instead of
unmasked and masked ones: a mask that keeps every row of a full tile changes no value), and the float64
reference; padded rows hold NaN, so a descriptor that reads past a sequence shows up. Layouts (B, H, L, D),
(B, L, H, D) permuted, expanded heads and packed tokens; causal; zero-length, one-token and full-length
sequences. Launches the variants do not serve (a bias, a key mask, dropout) are refused by the prune and by
the kernels' static asserts, never run; a dK/dV launch whose k or v no descriptor can read takes the pointer
loads. tests/unit/test_jagged_attention_compile.py compiles them for sm_90a (12 warps: specialized).
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common import attention_triton, tuned_launch
from gemcompile.lowering.jagged_attention import packed_triton
from gemcompile.lowering.jagged_attention import triton as kernels
from gemcompile.lowering.jagged_attention.packed import packed_reference_backward, packed_reference_forward
from gemcompile.lowering.jagged_attention.reference import reference_backward, reference_forward
from tests.unit.test_jagged_attention_tma import bhld_inputs, dirty, lengths_with_edges, rel

FWD, DKDV = kernels._fwd_kernel, kernels._bwd_dkdv_kernel
DEFAULT = {FWD: kernels._FWD_CONFIGS, DKDV: kernels._DKDV_CONFIGS}
WS = {FWD: kernels._FWD_WS_CONFIGS, DKDV: kernels._DKDV_WS_CONFIGS}


def chosen_ws(kernel) -> list:
    """WS of the configs the autotuner chose for ``kernel``'s launches since the last ``pinned``."""
    return [bool(entry[1].kwargs.get("WS")) for key, entry in tuned_launch._BEST_CONFIG.items()
            if key[0] is kernel]


def pinned(monkeypatch, configs: dict, fn):
    """fn() with each kernel's config list pinned (kernel -> configs), tuned afresh (our launcher's and the
    autotuner's caches emptied)."""
    for kernel, listed in configs.items():
        monkeypatch.setattr(kernel, "configs", listed)
        monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(tuned_launch, "_BEST_CONFIG", {})
    return fn()


def padded_run(q, k, v, ql, kl, causal, scale, bias=None):
    def run():
        out, lse = kernels.jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, scale)
        g = dirty(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype), ql, 2)
        dq, dk, dv, _ = kernels.jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, causal,
                                                                 scale, False)
        return out, lse, dq, dk, dv, g
    return run


@pytest.mark.parametrize("layout", ["bhld", "blhd", "expanded_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_kernels_equal_tma_kernels_and_reference(monkeypatch, layout, causal):
    B, H, L, D = 5, 2, 45, 32
    g = torch.Generator().manual_seed(11 + causal)
    q, k, v = bhld_inputs(layout, B, H, L, D, g)
    ql, kl = lengths_with_edges(B, L, g), lengths_with_edges(B, L, g).flip(0)
    if layout != "expanded_heads":
        q, k, v = dirty(q, ql, 2), dirty(k, kl, 2), dirty(v, kl, 2)
    run = padded_run(q, k, v, ql, kl, causal, D ** -0.5)
    tma = pinned(monkeypatch, DEFAULT, run)
    assert chosen_ws(FWD) == [False] and chosen_ws(DKDV) == [False]
    ws = pinned(monkeypatch, WS, run)
    assert chosen_ws(FWD) == [True] and chosen_ws(DKDV) == [True]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ws[:5], tma[:5]):
        assert torch.equal(got, want), name
    out, lse, dq, dk, dv, grad = ws
    assert not any(t.isnan().any() for t in (out, dq, dk, dv))
    d64 = [t.double().nan_to_num(0.0) for t in (q, k, v)]
    ref_out, ref_lse = reference_forward(*d64, ql, kl, None, causal, D ** -0.5)
    assert rel(out, ref_out) < 2e-3
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite())
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-2
    ref = reference_backward(grad.double().nan_to_num(0.0), *d64, ref_out, ref_lse, ql, kl, None, causal,
                             D ** -0.5, False)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert rel(got, want) < 6e-3, name
    # rows past a query length (every row of an empty sequence) are 0; keys past a key length get 0 gradients
    for b in range(B):
        assert out[b, :, ql[b]:].eq(0).all() and dq[b, :, ql[b]:].eq(0).all()
        assert dk[b, :, kl[b]:].eq(0).all() and dv[b, :, kl[b]:].eq(0).all()


@pytest.mark.parametrize("q_packed", [False, True], ids=["dense_q", "packed_q"])
def test_ws_kernels_on_packed_tokens(monkeypatch, q_packed):
    """Packed k, v (T, H, D) with offsets (and packed q: causal self-attention): a sequence's descriptors stop
    at its last row, so the next sequence's rows are never read or written."""
    B, H, N, D = 5, 2, 50, 32
    lengths = torch.tensor([0, 37, 1, 16, 50])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    T = int(offsets[-1])
    g = torch.Generator().manual_seed(3 + q_packed)
    k, v = (torch.randn(T, H, D, generator=g).half() for _ in range(2))
    q = torch.randn(T, H, D, generator=g).half() if q_packed else torch.randn(B, H, 16, D, generator=g).half()
    ql = None if q_packed else torch.tensor([16, 3, 0, 9, 1])
    packed = {"token_offsets": offsets, "packed_len": N}

    def run():
        out, lse = packed_triton.jagged_attention_forward_triton(q, k, v, ql, None, None, q_packed, D ** -0.5,
                                                                 **packed)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
        grads = packed_triton.jagged_attention_backward_triton(grad, q, k, v, out, lse, ql, None, None, q_packed,
                                                               D ** -0.5, False, **packed)
        return out, lse, *grads[:3], grad

    tma = pinned(monkeypatch, DEFAULT, run)
    ws = pinned(monkeypatch, WS, run)
    assert chosen_ws(FWD) == [True] and chosen_ws(DKDV) == [True]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ws[:5], tma[:5]):
        assert torch.equal(got, want), name
    d64 = [t.double() for t in (q, k, v)]
    ref_out, ref_lse = packed_reference_forward(*d64, ql, None, None, q_packed, D ** -0.5, **packed)
    assert rel(ws[0], ref_out) < 3e-3
    ref = packed_reference_backward(ws[5].double(), *d64, ref_out, ref_lse, ql, None, None, q_packed, D ** -0.5,
                                    False, **packed)
    for name, got, want in zip(("dq", "dk", "dv"), ws[2:5], ref):
        assert rel(got, want) < 6e-3, name


def test_ws_configs_are_not_chosen_for_launches_they_do_not_serve(monkeypatch):
    """A bias (and likewise a key mask, uniform keys, dropout): the prune drops the WS configs, so the launch
    runs the other TMA configs; a list of WS configs alone is refused with the reason (by the prune, and by
    the kernels' static asserts where the autotuner does not prune: one config), never run."""
    B, H, L, D = 3, 2, 33, 32
    g = torch.Generator().manual_seed(5)
    q, k, v = bhld_inputs("bhld", B, H, L, D, g)
    lengths = lengths_with_edges(B, L, g)
    bias = torch.randn(1, H, L, L, generator=g).half()
    run = padded_run(q, k, v, lengths, lengths, False, D ** -0.5, bias)
    mixed = {kernel: [c for c in DEFAULT[kernel] if c.pre_hook is not None] + WS[kernel] for kernel in WS}
    out, *_ = pinned(monkeypatch, mixed, run)
    assert chosen_ws(FWD) == [False] and chosen_ws(DKDV) == [False]
    ref, _ = reference_forward(q.double(), k.double(), v.double(), lengths, lengths, bias.double(), False,
                               D ** -0.5)
    assert rel(out, ref) < 2e-3
    for kernel, ws_configs in WS.items():
        with pytest.raises(Exception, match="warp-specialized"):
            pinned(monkeypatch, {**mixed, kernel: ws_configs}, run)
        with pytest.raises(ValueError, match="warp-specialized.*HAS_BIAS"):
            pinned(monkeypatch, {**mixed, kernel: ws_configs * 2}, run)


def test_dkdv_ws_needs_k_and_v_readable_by_descriptors(monkeypatch):
    """The WS dK/dV reads the key tile through a descriptor too: k whose rows are not 16-byte aligned (q and
    dO are) sends its launch to the pointer loads while WS configs are listed."""
    B, H, L, D = 3, 2, 33, 32
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, H, L, D, generator=g).half()
    wide = torch.randn(B, H, L, 36, generator=g).half()  # rows of 72 bytes
    k, v = wide[..., 2:34], torch.randn(B, H, L, D, generator=g).half()
    lengths = lengths_with_edges(B, L, g)
    seen = []
    real = kernels.launch

    def spy(kernel, grid, args, consts, buckets):
        seen.append((kernel, consts["USE_TMA"]) if "USE_TMA" in consts else (kernel, None))
        return real(kernel, grid, args, consts, buckets)

    monkeypatch.setattr(kernels, "launch", spy)
    run = padded_run(q, k, v, lengths, lengths, False, D ** -0.5)
    pinned(monkeypatch, {DKDV: DEFAULT[DKDV] + WS[DKDV]}, run)
    assert (DKDV, False) in seen and chosen_ws(DKDV) == [False]
    seen.clear()
    pinned(monkeypatch, {DKDV: DEFAULT[DKDV]}, run)
    assert (DKDV, True) in seen  # without WS configs listed, q and dO alone decide


@pytest.mark.parametrize("kernel", ["fwd", "dkdv"])
@pytest.mark.parametrize("flag", ["HAS_BIAS", "HAS_KV_MASK", "HAS_UNIFORM", "DROPOUT", None])
def test_prune_keeps_ws_configs_only_for_plain_tma_launches(kernel, flag):
    shapes = {"fwd": (kernels._FWD_SHAPES, kernels._FWD_TMA_SHAPES, kernels._FWD_WS_SHAPES),
              "dkdv": (kernels._DKDV_SHAPES, kernels._DKDV_TMA_SHAPES, kernels._DKDV_WS_SHAPES)}[kernel]
    prune = attention_triton.make_prune(shapes[0], kernel, *shapes[1:])["early_config_prune"]
    k = {"fwd": FWD, "dkdv": DKDV}[kernel]
    configs = DEFAULT[k] + WS[k]
    args = {"HEAD_D": 32, "LQ_BUCKET": 64, "LK_BUCKET": 64, "USE_TMA": True, "Q": torch.empty(1).half(),
            **({flag: True} if flag else {})}
    kept = prune(configs, args)
    assert any(c.kwargs.get("WS") for c in kept) == (flag is None)
    assert kept and all(c.pre_hook is not None for c in kept)
    # a launch on pointer loads (no TMA) never takes them
    assert not any(c.kwargs.get("WS") for c in prune(configs, dict(args, USE_TMA=False)))


def test_the_switch_is_refused_on_a_gpu_machine():
    """On an H200 the WS configs gave wrong outputs (gpu-tests-20261206-044823): with a GPU visible,
    GEMCOMPILE_WARP_SPECIALIZE=1 stops at import with a message naming the variable; without one it still
    offers the configs to the interpreter."""
    import subprocess
    import sys

    probe = ("import torch; torch.cuda.is_available = lambda: {gpu}\n"
             "import gemcompile.lowering.common.warp_specialize as w; print(w.WARP_SPECIALIZE)")
    env = {**os.environ, "GEMCOMPILE_WARP_SPECIALIZE": "1"}
    with_gpu = subprocess.run([sys.executable, "-c", probe.format(gpu=True)], capture_output=True, text=True, env=env)
    assert with_gpu.returncode != 0 and "unset GEMCOMPILE_WARP_SPECIALIZE" in with_gpu.stderr
    without = subprocess.run([sys.executable, "-c", probe.format(gpu=False)], capture_output=True, text=True, env=env)
    assert without.returncode == 0 and without.stdout.strip() == "True", without.stderr[-2000:]
