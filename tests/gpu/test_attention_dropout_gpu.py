"""Attention dropout on CUDA: the Triton kernels draw the same keep mask as the CPU reference for one seed
(every layout, fp32 and bf16, forward and backward), and a model training with attention dropout through
gem_compile (Inductor) is rewritten and drops a fraction p of the weights without bias.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_attention_dropout_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gemcompile.lowering  # noqa: E402,F401
from gemcompile import explain, gem_compile  # noqa: E402
from gemcompile.lowering.jagged_attention import packed_triton  # noqa: E402
from gemcompile.lowering.jagged_attention.packed import (  # noqa: E402
    packed_reference_backward,
    packed_reference_forward,
)
from tests.integration.test_attention_dropout_pass import (  # noqa: E402
    MergedHeadsDropout,
    _inputs,
    check_new_draws_every_step_and_unbiased,
)
from tests.unit.test_attention_dropout import _layout_case, _rel  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (2e-2, 4e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout, causal", [(layout, causal) for layout in ("padded", "kv_mask", "bias", "packed_self")
                                            for causal in (False, True)] + [("packed_keys", False)])
def test_kernels_equal_the_reference_for_one_seed(layout, causal, dtype):
    torch.set_float32_matmul_precision("highest")
    g = torch.Generator().manual_seed(5)
    q, k, v, bias, kw = _layout_case(layout, causal, g)
    q_lengths, kv_lengths = kw.pop("q_lengths"), kw.pop("kv_lengths")
    cuda = [None if t is None else t.cuda() for t in (q, k, v, bias, q_lengths, kv_lengths, kw.get("kv_mask"))]
    qc, kc, vc = (t.to(dtype) for t in cuda[:3])
    bc = None if cuda[3] is None else cuda[3].to(dtype)
    packed = {n: kw[n].cuda() if n == "token_offsets" else kw[n] for n in ("token_offsets", "packed_len") if n in kw}
    seed = torch.tensor(2**40 + 123)
    out, lse = packed_triton.jagged_attention_forward_triton(qc, kc, vc, cuda[4], cuda[5], bc, causal, 0.25,
                                                             cuda[6], None, 0.4, seed.cuda(), **packed)
    cpu_packed = {n: kw[n] for n in ("token_offsets", "packed_len") if n in kw}
    d64 = [None if t is None else t.to(dtype).double() for t in (q, k, v, bias)]
    ref_out, ref_lse = packed_reference_forward(*d64[:3], q_lengths, kv_lengths, d64[3], causal, 0.25,
                                                kw.get("kv_mask"), None, 0.4, seed, **cpu_packed)
    fwd_tol, bwd_tol = TOL[dtype]
    assert _rel(out.cpu(), ref_out) < fwd_tol
    grad = torch.randn(out.shape, generator=g)
    got = packed_triton.jagged_attention_backward_triton(grad.cuda().to(dtype), qc, kc, vc, out, lse, cuda[4],
                                                         cuda[5], bc, causal, 0.25, bias is not None, cuda[6], None,
                                                         0.4, seed.cuda(), **packed)
    want = packed_reference_backward(grad.to(dtype).double(), *d64[:3], ref_out, ref_lse, q_lengths, kv_lengths,
                                     d64[3], causal, 0.25, bias is not None, kw.get("kv_mask"), None, 0.4, seed,
                                     **cpu_packed)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        if b.numel():
            assert _rel(a.cpu(), b) < bwd_tol, (name, _rel(a.cpu(), b))


def test_training_through_gem_compile_is_rewritten_and_unbiased():
    torch.manual_seed(0)
    model = MergedHeadsDropout(p=0.5).cuda().train()
    hidden, lengths = (t.cuda() for t in _inputs("lengths", torch.Generator().manual_seed(2)))
    assert explain(model, hidden, lengths).counts["jagged_attention"] == 1
    compiled = gem_compile(model)
    check_new_draws_every_step_and_unbiased(compiled, model, hidden, lengths)
    out = compiled(hidden.detach().requires_grad_(), lengths)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["block_causal", "window", "block_window_rotary", "kv_mask", "packed",
                                  "closed_shape"])
def test_block_kernels_equal_the_reference_for_one_seed(name, dtype):
    """block_attention's general kernels with dropout on CUDA against the CPU reference in float64."""
    from gemcompile.lowering.block_attention import triton as block_kernels
    from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward
    from tests.unit.test_block_attention_dropout import SEED, block_case

    torch.set_float32_matmul_precision("highest")
    g = torch.Generator().manual_seed(1)
    q, k, v, args, kw = block_case(name, 64 if name == "closed_shape" else 96, 64, g)
    q, k, v = (t.to(dtype).float() for t in (q, k, v))
    cuda_args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in args]
    cuda_kw = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    qc, kc, vc = (t.cuda().to(dtype) for t in (q, k, v))
    out, lse = block_kernels.block_attention_forward_triton(qc, kc, vc, *cuda_args, **cuda_kw, dropout_p=0.4,
                                                            dropout_seed=SEED.cuda())
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), *args, **kw, dropout_p=0.4,
                                         dropout_seed=SEED)
    fwd_tol, bwd_tol = TOL[dtype]
    assert _rel(out.cpu(), ref_out) < fwd_tol
    grad = torch.randn(out.shape, generator=g)
    got = block_kernels.block_attention_backward_triton(grad.cuda().to(dtype), qc, kc, vc, out, lse, *cuda_args,
                                                        **cuda_kw, dropout_p=0.4, dropout_seed=SEED.cuda())
    want = reference_backward(grad.to(dtype).double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                              *args, **kw, dropout_p=0.4, dropout_seed=SEED)
    for a, b in zip(got, want):
        assert _rel(a.cpu(), b) < bwd_tol
