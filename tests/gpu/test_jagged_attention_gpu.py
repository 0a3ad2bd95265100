"""gemcompile::jagged_attention on CUDA (the Triton kernels) against the float64 reference.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_jagged_attention_gpu.py
Most tests pin one config per kernel (``single_config``) so that they compile few kernel variants;
``test_every_autotune_config`` checks each config of the autotune lists for the benchmark's variants
(bf16, D 64 and 128), which also warms the Triton cache for benchmarks/jagged_attention.py.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_checks import TOL, pin_tiles, rel  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401
from gemcompile.lowering.jagged_attention import triton as kernels  # noqa: E402
from gemcompile.lowering.common.checks import strict_length_checks  # noqa: E402
from gemcompile.lowering.jagged_attention.reference import (  # noqa: E402
    key_mask,
    reference_backward,
    reference_forward,
)

ops = torch.ops.gemcompile
DEV = "cuda"


def _pin(monkeypatch, fwd, dkdv, dq):
    pin_tiles(monkeypatch, {kernels._fwd_kernel: fwd, kernels._bwd_dkdv_kernel: dkdv, kernels._bwd_dq_kernel: dq})


@pytest.fixture
def single_config(monkeypatch):
    """One mid-size config per kernel (valid for every head dim and dtype: fp32 at D=128 needs two stages
    and 32-key steps in dQ to fit shared memory): few compiles, many partial tiles."""
    _pin(monkeypatch, (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))


def jagged_lengths(B, L, g):
    """0, 1, odd, L, then uniform: every special case in every batch."""
    special = [0, 1, L, (L // 2) | 1, L - 1]
    rand = torch.randint(0, L + 1, (B,), generator=g)
    return torch.tensor([special[i] if i < len(special) else int(rand[i]) for i in range(B)])


def make_case(B, H, Lq, Lk, D, dtype, shared_q=False, bias_shape=None, q_lengths=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1 if shared_q else B, H, Lq, D, generator=g).to(DEV, dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(DEV, dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(DEV, dtype)
    ql = jagged_lengths(B, Lq, g).roll(2).to(DEV) if q_lengths else None
    kl = jagged_lengths(B, Lk, g).to(DEV)
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(DEV, dtype)
    return q, k, v, ql, kl, bias


def run_op(q, k, v, ql, kl, bias, causal, scale, grad_out, bias_grad=True, kv_mask=None, uniform_keys=None):
    # detach (not clone): permuted and expanded views must reach the op with their strides
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_(bias_grad)
    out = ops.jagged_attention(*leaves, ql, kl, b, causal, scale, kv_mask, uniform_keys)
    out.backward(grad_out)
    grads = [x.grad for x in leaves] + [None if (b is None or not bias_grad) else b.grad]
    return out.detach(), grads


def check_case(q, k, v, ql, kl, bias, causal, bias_grad=True, seed=1, kv_mask=None, uniform_keys=None):
    dtype = q.dtype
    D = q.shape[-1]
    scale = 1 / math.sqrt(D)
    grad_out = torch.randn(k.shape[0], *q.shape[1:], generator=torch.Generator().manual_seed(seed)).to(
        DEV, dtype
    )
    out, grads = run_op(q, k, v, ql, kl, bias, causal, scale, grad_out, bias_grad, kv_mask, uniform_keys)
    d64 = [None if x is None else x.double() for x in (q, k, v, bias)]
    ref_out, ref_lse = reference_forward(*d64[:3], ql, kl, d64[3], causal, scale, kv_mask, uniform_keys)
    ref = reference_backward(
        grad_out.double(),
        *d64[:3],
        ref_out,
        ref_lse,
        ql,
        kl,
        d64[3],
        causal,
        scale,
        bias is not None and bias_grad,
        kv_mask,
        uniform_keys,
    )
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    if ql is not None:  # padded query rows are exactly zero
        pad = torch.arange(q.shape[2], device=DEV)[None, :] >= ql[:, None]
        assert (out.transpose(1, 2)[pad] == 0).all()
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, ref):
        if got is None:
            continue
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    if kv_mask is not None:  # keys that are not valid: exactly zero dK and dV
        bad = ~key_mask(kl, kv_mask, k.shape[0], k.shape[2], DEV)
        assert (grads[1].transpose(1, 2)[bad] == 0).all() and (grads[2].transpose(1, 2)[bad] == 0).all()


CASES = [  # dtype, D, L (q and kv), causal, bias, shared_q, q_lengths
    (torch.float16, 32, 1024, False, None, False, True),
    (torch.float16, 96, 517, True, "full", False, True),
    (torch.float16, 128, 333, False, "heads_keys", True, True),
    (torch.bfloat16, 32, 301, True, None, True, True),
    (torch.bfloat16, 64, 1024, False, "heads_keys", False, True),
    (torch.bfloat16, 96, 640, False, None, False, False),
    (torch.bfloat16, 128, 1024, True, None, False, True),
    (torch.bfloat16, 128, 257, False, "full", False, True),
    (torch.float32, 64, 517, True, "full", False, True),
    (torch.float32, 128, 300, False, None, True, True),
    (torch.float32, 32, 1024, False, "batch_keys", False, False),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{str(c[0])[6:]}-D{c[1]}-L{c[2]}-{'causal' if c[3] else 'full'}"
        f"-bias_{c[4]}-{'sharedq' if c[5] else 'q'}"
    ),
)
def test_matches_float64_reference(single_config, case):
    dtype, D, L, causal, bias_kind, shared_q, with_q_lengths = case
    B, H = 7, 2
    bias_shape = {None: None, "full": (B, H, L, L), "heads_keys": (1, H, 1, L), "batch_keys": (B, 1, 1, L)}[
        bias_kind
    ]
    q, k, v, ql, kl, bias = make_case(B, H, L, L, D, dtype, shared_q, bias_shape, with_q_lengths, seed=D + L)
    check_case(q, k, v, ql, kl, bias, causal)


@pytest.mark.parametrize("Lq,Lk,causal", [(16, 1000, False), (1000, 48, True), (1, 513, False)])
def test_cross_lengths(single_config, Lq, Lk, causal):
    q, k, v, ql, kl, bias = make_case(6, 2, Lq, Lk, 64, torch.bfloat16, seed=Lq)
    check_case(q, k, v, ql, kl, bias, causal)


@pytest.mark.parametrize("D", [64, 128])
def test_every_autotune_config(monkeypatch, D):
    """Each config the autotuner may pick for the benchmark's variants (bf16, non-causal, no bias)."""
    head = "small" if D <= 64 else "large"
    fwd = [c for c, heads in kernels._FWD_SHAPES.items() if head in heads]
    dkdv = [c for c, heads in kernels._DKDV_SHAPES.items() if head in heads]
    dq = [c for c, heads in kernels._DQ_SHAPES.items() if head in heads]
    q, k, v, ql, kl, _ = make_case(6, 2, 512, 512, D, torch.bfloat16, seed=D)
    ql = kl  # self-attention, as in the benchmark
    for i in range(max(len(fwd), len(dkdv), len(dq))):
        _pin(monkeypatch, fwd[i % len(fwd)], dkdv[i % len(dkdv)], dq[i % len(dq)])
        check_case(q, k, v, ql, kl, None, False)


def _tma_configs(configs, shapes, head):
    """The TMA variant's configs (those with the descriptors' pre_hook) listed for the head dim class."""
    return [c for c in configs if c.pre_hook is not None and not c.kwargs.get("WS") and head in shapes.get(
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), ())]


@pytest.mark.parametrize("D", [64, 128])
def test_every_tma_config(monkeypatch, D):
    """Each TMA config the autotuner may pick (the launch takes the TMA loads whatever its size here), one
    per kernel at a time, against float64: causal and not, the TMA loads' row bounds at partial tiles."""
    monkeypatch.setattr(kernels, "tma_worth", lambda work: True)
    head = "small" if D <= 64 else "large"
    lists = [_tma_configs(kernels._FWD_CONFIGS, kernels._FWD_TMA_SHAPES, head),
             _tma_configs(kernels._DKDV_CONFIGS, kernels._DKDV_TMA_SHAPES, head),
             _tma_configs(kernels._DQ_CONFIGS, kernels._DQ_TMA_SHAPES, head)]
    assert all(lists), lists
    q, k, v, ql, kl, _ = make_case(5, 2, 384, 384, D, torch.bfloat16, seed=D + 1)
    for i in range(max(map(len, lists))):
        for kernel, configs in zip((kernels._fwd_kernel, kernels._bwd_dkdv_kernel, kernels._bwd_dq_kernel), lists):
            monkeypatch.setattr(kernel, "configs", [configs[i % len(configs)]])
        check_case(q, k, v, kl, kl, None, i % 2 == 1)


def test_backward_is_deterministic(single_config):
    q, k, v, ql, kl, bias = make_case(
        5, 2, 400, 400, 64, torch.bfloat16, shared_q=True, bias_shape=(1, 2, 400, 400)
    )
    g = torch.randn(5, 2, 400, 64, device=DEV, dtype=torch.bfloat16)
    first = run_op(q, k, v, ql, kl, bias, True, 0.125, g)
    second = run_op(q, k, v, ql, kl, bias, True, 0.125, g)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


def test_zero_lengths_give_zeros_not_nan(single_config):
    q, k, v, _, _, bias = make_case(4, 2, 256, 256, 64, torch.float16, bias_shape=(4, 2, 256, 256))
    zeros = torch.zeros(4, dtype=torch.int32, device=DEV)
    g = torch.randn(4, 2, 256, 64, device=DEV, dtype=torch.float16)
    for causal in (False, True):
        out, grads = run_op(q, k, v, zeros, zeros, bias, causal, 0.125, g)
        assert (out == 0).all()
        assert all((x == 0).all() for x in grads)
        out, grads = run_op(q, k, v, None, zeros, bias, causal, 0.125, g)
        assert (out == 0).all() and all(not x.isnan().any() for x in grads)


def test_permuted_views_and_expanded_queries(single_config):
    B, L, H, D = 5, 300, 4, 64
    x = torch.randn(B, L, 3, H, D, device=DEV, dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
    assert not q.is_contiguous()
    kl = torch.tensor([300, 0, 1, 77, 299], device=DEV)
    check_case(q, k, v, kl, kl, None, True)
    learned = torch.randn(1, H, 8, D, device=DEV, dtype=torch.bfloat16).expand(B, H, 8, D)
    check_case(learned, k, v, None, kl, None, False)


def test_no_host_sync(single_config):
    q, k, v, ql, kl, bias = make_case(6, 2, 512, 512, 64, torch.bfloat16, bias_shape=(1, 2, 512, 512))
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def step():
        out = ops.jagged_attention(leaves[0], leaves[1], leaves[2], ql, kl, leaves[3], True, 0.125)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    step()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compile_fullgraph_no_recompile(single_config):
    B, H, L, D = 6, 2, 256, 64
    q, k, v, _, _, bias = make_case(B, H, L, L, D, torch.bfloat16, bias_shape=(1, H, L, L))
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, ql, kl):
        return ops.jagged_attention(q, k, v, ql, kl, bias, False, 0.125).float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            ql = torch.randint(0, L + 1, (B,), generator=g).to(DEV)
            kl = torch.randint(0, L + 1, (B,), generator=g).to(DEV)
            got = torch.autograd.grad(compiled(*leaves, ql, kl), leaves)
            want = torch.autograd.grad(f(*leaves, ql, kl), leaves)
            for a, b in zip(got, want):
                assert rel(a, b) < 1e-2


def test_int64_addressing_beyond_2_31_elements(single_config):
    """Tensors with more than 2**31 elements: sequence bases need int64 offsets."""
    B, H, L, D = 4100, 4, 1024, 128  # 2.15e9 elements per tensor (4.3 GB in bf16)
    q = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    kl = torch.randint(0, 9, (B,), device=DEV)
    kl[-1] = L
    kl[-2] = 333
    out, lse = ops.jagged_attention_fwd(q, k, v, kl, kl, None, False, D**-0.5)
    tail = slice(B - 2, B)
    ref, ref_lse = reference_forward(
        q[tail].double(), k[tail].double(), v[tail].double(), kl[tail], kl[tail], None, False, D**-0.5
    )
    assert rel(out[tail], ref) < TOL[torch.bfloat16][0]
    g = torch.randn_like(out)
    dq, dk, dv, _ = ops.jagged_attention_bwd(g, q, k, v, out, lse, kl, kl, None, False, D**-0.5, False)
    ref_grads = reference_backward(
        g[tail].double(),
        q[tail].double(),
        k[tail].double(),
        v[tail].double(),
        ref,
        ref_lse,
        kl[tail],
        kl[tail],
        None,
        False,
        D**-0.5,
        False,
    )
    for a, b in zip((dq, dk, dv), ref_grads[:3]):
        assert rel(a[tail], b) < TOL[torch.bfloat16][1]


def test_strict_length_checks_on_cuda(single_config):
    q, k, v, _, _, _ = make_case(3, 2, 64, 64, 64, torch.float16)
    wild = torch.tensor([70, -3, 64], device=DEV)
    out = ops.jagged_attention(q, k, v, wild, wild, None, False, 0.125)  # clamped into [0, 64]
    clamped = ops.jagged_attention(q, k, v, wild.clamp(0, 64), wild.clamp(0, 64), None, False, 0.125)
    assert torch.equal(out, clamped)
    with strict_length_checks(True):
        with pytest.raises(ValueError, match="q_lengths"):
            ops.jagged_attention(q, k, v, wild, wild, None, False, 0.125)


def test_float64_on_cuda_uses_the_reference():
    q, k, v, ql, kl, bias = make_case(3, 2, 40, 40, 16, torch.float64, bias_shape=(1, 2, 40, 40))
    check_case(q, k, v, ql, kl, bias, True)


def test_flop_counter_on_cuda(single_config):
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, ql, kl, _ = make_case(4, 2, 128, 128, 64, torch.bfloat16)
    q.requires_grad_(True)
    pairs = int((ql.clamp(0, 128) * kl.clamp(0, 128)).sum())
    with FlopCounterMode(display=False) as counter:
        ops.jagged_attention(q, k, v, ql, kl, None, False, 0.125).sum().backward()
    assert counter.get_total_flops() == int(3.5 * 4 * 2 * 64 * pairs)


def test_eager_path_and_custom_ops_agree_bitwise(single_config):
    """Plain eager calls take the autograd.Function fast path; traced calls take the custom ops. Same
    kernels, deterministic: the results must be identical."""
    from gemcompile.lowering.common.opkit import takes_eager_path

    q, k, v, ql, kl, bias = make_case(5, 2, 300, 300, 64, torch.bfloat16, bias_shape=(1, 2, 300, 300))
    assert takes_eager_path(q)
    g = torch.randn(5, 2, 300, 64, device=DEV, dtype=torch.bfloat16)

    def grads(call):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, bias)]
        out = call(*leaves)
        return (out, *torch.autograd.grad(out, leaves, g))

    fast = grads(lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, True, 0.125))
    via_ops = grads(lambda q, k, v, b: ops.jagged_attention_fwd(q, k, v, ql, kl, b, True, 0.125)[0])
    for a, b in zip(fast, via_ops):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# kv_mask (keys masked by data) and kv_lengths None


def make_kv_mask(kind, B, L, seed=0):
    """(B, L) bool on the GPU: "holes" random, "left_pad" a valid suffix, "right_pad" a valid prefix,
    "window" one contiguous run (no holes), "expanded" one (1, L) row expanded to (B, L); rows 0 and 1 are
    all-False and all-True."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(L)
    if kind == "holes":
        m = torch.rand(B, L, generator=g) < 0.6
    elif kind == "expanded":
        return (torch.rand(1, L, generator=g) < 0.6).expand(B, L).to(DEV)
    elif kind == "window":
        ends = torch.randint(0, L + 1, (2, B), generator=g).sort(dim=0).values
        m = (pos[None, :] >= ends[0][:, None]) & (pos[None, :] < ends[1][:, None])
    else:
        edges = torch.randint(0, L + 1, (B,), generator=g)
        m = pos[None, :] >= edges[:, None] if kind == "left_pad" else pos[None, :] < edges[:, None]
    m[0] = False
    m[1] = True
    return m.to(DEV)


MASK_CASES = [  # dtype, D, L, causal, mask kind, with kv_lengths, bias
    (torch.bfloat16, 64, 1000, False, "holes", True, None),
    (torch.bfloat16, 64, 1000, True, "left_pad", False, None),
    (torch.bfloat16, 128, 1000, False, "right_pad", True, "heads_keys"),
    (torch.bfloat16, 128, 777, True, "holes", False, "full"),
    (torch.bfloat16, 64, 513, False, "expanded", True, None),
    (torch.float32, 64, 1000, True, "holes", True, None),
    (torch.float32, 128, 1000, False, "left_pad", False, "heads_keys"),
    (torch.float32, 128, 300, True, "right_pad", True, None),
    (torch.float32, 64, 257, False, "expanded", False, "full"),
    (torch.bfloat16, 64, 1000, True, "window", False, "full"),
    (torch.float32, 128, 700, False, "window", True, None),
]


@pytest.mark.parametrize(
    "case", MASK_CASES,
    ids=lambda c: f"{str(c[0])[6:]}-D{c[1]}-L{c[2]}-{'causal' if c[3] else 'full'}-{c[4]}-"
                  f"{'kvlen' if c[5] else 'nokvlen'}-bias_{c[6]}",
)
def test_kv_mask_matches_float64_reference(single_config, case):
    dtype, D, L, causal, kind, with_kv_lengths, bias_kind = case
    B, H = 6, 2
    bias_shape = {None: None, "full": (B, H, L, L), "heads_keys": (1, H, 1, L)}[bias_kind]
    q, k, v, ql, kl, bias = make_case(B, H, L, L, D, dtype, bias_shape=bias_shape, seed=D + L)
    mask = make_kv_mask(kind, B, L, L)
    check_case(q, k, v, ql, kl if with_kv_lengths else None, bias, causal, kv_mask=mask)


@pytest.mark.parametrize("D", [64, 128])
def test_kv_mask_autotuned(D):
    """No pinned config: whatever the autotuner picks, with a mask and no kv_lengths."""
    q, k, v, ql, _, _ = make_case(4, 2, 1000, 1000, D, torch.bfloat16, seed=D)
    check_case(q, k, v, ql, None, None, True, kv_mask=make_kv_mask("left_pad", 4, 1000, D))


def test_kv_mask_cross_lengths(single_config):
    q, k, v, ql, kl, _ = make_case(5, 2, 16, 1000, 64, torch.bfloat16, seed=3)
    check_case(q, k, v, ql, kl, None, False, kv_mask=make_kv_mask("holes", 5, 1000, 3))
    check_case(q, k, v, None, None, None, False, kv_mask=make_kv_mask("right_pad", 5, 1000, 4))


def test_no_kv_lengths_no_mask(single_config):
    q, k, v, ql, _, bias = make_case(4, 2, 300, 300, 64, torch.bfloat16, bias_shape=(1, 2, 300, 300))
    check_case(q, k, v, ql, None, bias, True)
    check_case(q, k, v, None, None, None, False)


def test_kv_mask_no_host_sync_and_eager_matches_ops(single_config):
    q, k, v, ql, kl, bias = make_case(6, 2, 512, 512, 64, torch.bfloat16, bias_shape=(1, 2, 512, 512))
    mask = make_kv_mask("holes", 6, 512)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]
    g = torch.randn(6, 2, 512, 64, device=DEV, dtype=torch.bfloat16)

    def step():
        out = ops.jagged_attention(leaves[0], leaves[1], leaves[2], ql, None, leaves[3], True, 0.125, mask)
        return (out, *torch.autograd.grad(out, leaves, g))

    fast = step()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    via_ops = (ops.jagged_attention_fwd(*leaves[:3], ql, None, leaves[3], True, 0.125, mask)[0],)
    via_ops = (*via_ops, *torch.autograd.grad(via_ops[0], leaves, g))
    for a, b in zip(fast, via_ops):
        assert torch.equal(a, b)


def test_kv_mask_without_holes_runs_like_lengths(single_config):
    """A right-padding mask (no holes) takes the lengths path's loop split: the same tiles, unmasked
    inside, so the same forward bits as kv_lengths; the backward agrees closely."""
    B, H, L, D = 6, 2, 1000, 64
    q, k, v, ql, kl, bias = make_case(B, H, L, L, D, torch.bfloat16, bias_shape=(1, H, L, L), seed=5)
    mask = torch.arange(L, device=DEV)[None, :] < kl[:, None]
    g = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16)
    for causal in (False, True):
        a, ga = run_op(q, k, v, ql, None, bias, causal, 0.125, g, kv_mask=mask)
        b, gb = run_op(q, k, v, ql, kl, bias, causal, 0.125, g)
        assert torch.equal(a, b)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------
# uniform_keys (a sequence's scores all taken as 0)


UNIFORM_CASES = [  # dtype, D, L, causal, mask kind (None: no kv_mask), bias
    (torch.bfloat16, 64, 1000, False, None, "full"),
    (torch.bfloat16, 128, 777, True, "holes", "heads_keys"),
    (torch.bfloat16, 64, 513, True, "left_pad", None),
    (torch.float32, 64, 1000, False, "holes", "full"),
    (torch.float32, 128, 300, True, None, None),
]


@pytest.mark.parametrize(
    "case", UNIFORM_CASES,
    ids=lambda c: f"{str(c[0])[6:]}-D{c[1]}-L{c[2]}-{'causal' if c[3] else 'full'}-mask_{c[4]}-bias_{c[5]}",
)
def test_uniform_keys_match_float64_reference(single_config, case):
    dtype, D, L, causal, kind, bias_kind = case
    B, H = 6, 2
    bias_shape = {None: None, "full": (B, H, L, L), "heads_keys": (1, H, 1, L)}[bias_kind]
    q, k, v, ql, kl, bias = make_case(B, H, L, L, D, dtype, bias_shape=bias_shape, seed=D + L + 1)
    mask = None if kind is None else make_kv_mask(kind, B, L, L)
    uniform = torch.tensor([True, True, False, True, False, True], device=DEV)
    check_case(q, k, v, ql, kl, bias, causal, kv_mask=mask, uniform_keys=uniform)


def test_uniform_keys_eager_matches_ops_without_host_sync(single_config):
    q, k, v, ql, _, bias = make_case(6, 2, 512, 512, 64, torch.bfloat16, bias_shape=(1, 2, 512, 512))
    mask = make_kv_mask("window", 6, 512)
    uniform = torch.tensor([False, True, True, False, True, False], device=DEV)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]
    g = torch.randn(6, 2, 512, 64, device=DEV, dtype=torch.bfloat16)

    def step():
        out = ops.jagged_attention(*leaves[:3], ql, None, leaves[3], True, 0.125, mask, uniform)
        return (out, *torch.autograd.grad(out, leaves, g))

    fast = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    via_ops = (ops.jagged_attention_fwd(*leaves[:3], ql, None, leaves[3], True, 0.125, mask, uniform)[0],)
    via_ops = (*via_ops, *torch.autograd.grad(via_ops[0], leaves, g))
    for a, b in zip(fast, via_ops):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_delta_in_the_dq_kernel_with_an_lse_gradient(monkeypatch, dtype, packed):
    """The backward with delta computed in the dQ kernel (the default) against float64 and against the
    separate delta kernel (GEMCOMPILE_DELTA_IN_DQ=0), with a gradient on lse (it enters delta), causal,
    every autotuned config of the launch (the tuning runs rewrite delta: each must write the same)."""
    from gemcompile.lowering.common.packed import pack_padded
    from gemcompile.lowering.jagged_attention import packed_triton
    from gemcompile.lowering.jagged_attention.packed import packed_reference_backward, packed_reference_forward

    B, H, L, D = 6, 3, 300, 64
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(DEV, dtype) for _ in range(3))
    lengths = jagged_lengths(B, L, g).to(DEV)
    kw, q_lengths, kv_lengths = {}, lengths, lengths
    if packed:
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        q, k, v = (pack_padded(t, offsets, int(offsets[-1])) for t in (q, k, v))
        kw, q_lengths, kv_lengths = dict(token_offsets=offsets, packed_len=L), None, None
    out, lse = packed_triton.jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, None, True, 0.1, **kw)
    grad_out = torch.randn(out.shape, generator=g).to(DEV, dtype)
    grad_lse = torch.randn(lse.shape, generator=g).to(DEV)

    def backward():
        return packed_triton.jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths,
                                                              None, True, 0.1, False, None, None, 0.0, None,
                                                              grad_lse, **kw)

    got = backward()
    monkeypatch.setattr(kernels, "DELTA_IN_DQ", False)
    separate = backward()
    d64 = [t.double() for t in (q, k, v)]
    ref_out, ref_lse = packed_reference_forward(*d64, q_lengths, kv_lengths, None, True, 0.1, **kw)
    want = packed_reference_backward(grad_out.double(), *d64, ref_out, ref_lse, q_lengths, kv_lengths, None, True,
                                     0.1, False, None, None, 0.0, None, grad_lse.double(), **kw)
    for name, a, s, w in zip(("dq", "dk", "dv"), got, separate, want):
        assert not a.isnan().any(), name
        assert rel(a, w) < TOL[dtype][1], (name, rel(a, w))
        assert rel(a, s) < TOL[dtype][1], (name, rel(a, s))
