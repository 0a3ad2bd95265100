"""The packed attention ops' outputs keep the unbacked token count T out of their strides.

Under torch.compile the packed length T is an unbacked SymInt (valid_token_index). A tensor whose T is not
its leading size gets a stride like Max(1, T); CUDA-graph trees then compare the strides of every graph
input (torch 2.11's complex_memory_overlap sorts them) and Inductor fails with GuardOnDataDependentSymNode
Eq(Max(1, u0), 1): seen on the H200 with block_attention's former (H, T) lse, GEM-ref small under
mode="reduce-overhead" with token buckets. So every packed output, forward and backward, is checked here on
the fake implementations, with a real unbacked T.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

import gemcompile.lowering.block_attention.op  # noqa: F401  registers the ops
import gemcompile.lowering.gdpa.op  # noqa: F401
import gemcompile.lowering.jagged_attention.op  # noqa: F401
from gemcompile.lowering.valid_tokens import valid_token_index

B, L, H, D, S = 3, 16, 2, 16, 5
ops = torch.ops.gemcompile


def block_attention(q, lengths, offsets):
    out, lse = ops.block_attention_fwd(q, q, q, lengths, 4, -1, False, None, None, "none", 0.3, None, None,
                                       None, offsets, L)
    grads = ops.block_attention_bwd(out, q, q, q, out, lse, lengths, 4, -1, False, None, None, "none", 0.3,
                                    None, None, None, offsets, L)
    return {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}


def jagged_attention(q, lengths, offsets):
    out, lse = ops.jagged_attention_fwd(q, q, q, lengths, lengths, None, False, 0.3, token_offsets=offsets,
                                        packed_len=L)
    grads = ops.jagged_attention_bwd(out, q, q, q, out, lse, lengths, lengths, None, False, 0.3, False,
                                     token_offsets=offsets, packed_len=L)
    return {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv", "dbias"), grads))}


def gdpa(q, lengths, offsets):
    kv = torch.empty(B, H, S, D)  # dense keys: GEM-ref's cross-attention
    args = (lengths, None, None, "gelu", 1.0, 1.0, False, False, 0)
    out = ops.gdpa_fwd(q, kv, kv, *args, token_offsets=offsets, packed_len=L)
    grads = ops.gdpa_bwd(out, q, kv, kv, *args, False, token_offsets=offsets, packed_len=L)
    return {"out": out, **dict(zip(("dq", "dk", "dv", "dbias"), grads))}


@pytest.mark.parametrize("buckets", [0, 2])
@pytest.mark.parametrize("op", [block_attention, jagged_attention, gdpa], ids=lambda f: f.__name__)
def test_packed_outputs_keep_the_token_count_out_of_strides(op, buckets):
    with FakeTensorMode(shape_env=ShapeEnv()):
        lengths = torch.randint(0, L + 1, (B,))
        T = valid_token_index(lengths, L, 0, buckets).shape[0]
        q = torch.empty(T, H * D).view(T, H, D)  # a projection's rows viewed per head, as the pass passes it
        offsets = torch.zeros(B + 1, dtype=torch.int64)
        outputs = op(q, lengths, offsets)
    assert free_unbacked_symbols(q.shape[0]), "the test needs an unbacked T"
    checked = 0
    for name, t in outputs.items():
        if t is None or not free_unbacked_symbols(t.shape):
            continue  # dense-key gradients and absent bias gradients have no T
        assert not any(free_unbacked_symbols(s) for s in t.stride()), (name, t.shape, t.stride())
        checked += 1
    assert checked >= 2 + ("lse" in outputs)  # out and dq at least, and lse where the op returns one
