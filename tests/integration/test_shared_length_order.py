"""One batch order / key bounds per lengths (or key mask) tensor per step, shared by every attention op and
saved for the backward (issue 24; passes/attention/plans.py, lowering/length_order.py).

Models with several attention sites over one lengths tensor (jagged, block and GDPA sites) and over one key
mask run through the rewritten graph under aot_eager (the custom ops, no Inductor compile on CI's CPU):
the forward graph holds one derived node per distinct lengths / mask, the backward graph none, and one
forward + backward computes each order once (the counter of common/length_order.py). With the Triton
kernels forced onto the CPU interpreter the same graph runs the launchers, which then derive nothing
themselves, and outputs and gradients are bitwise those of the launchers deriving their own.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import GemConfig
from gemcompile.lowering.common import length_order as lo
from gemcompile.passes import PIPELINE
from gemcompile.passes.base import instantiate, run_pre_grad

B, L, L2, H, D, BS = 3, 16, 32, 1, 16, 8
E = H * D
DERIVED = ("length_order", "key_bounds")


def _split(x):
    return x.view(x.shape[0], x.shape[1], H, D).transpose(1, 2)


def _merge(x):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], E)


class _Sites(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(E, 3 * E) for _ in range(n))

    def qkv(self, i, x):
        return [_split(t) for t in self.proj[i](x).chunk(3, -1)]


class LengthSites(_Sites):
    """On x (lengths): two padded SDPA (jagged), a block-diagonal SDPA (block), a GELU attention masked on
    its rows afterwards (GDPA, ordered by its query lengths); on y (lengths2): one padded SDPA."""

    def __init__(self):
        super().__init__(5)

    def forward(self, x, lengths, y, lengths2):
        valid = torch.arange(L, device=x.device)[None, :] < lengths[:, None]
        for i in range(2):
            q, k, v = self.qkv(i, x)
            x = x + _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :]))
        i = torch.arange(L, device=x.device)
        block = (i // BS)[:, None] == (i // BS)[None, :]
        q, k, v = self.qkv(2, x)
        mask = block[None, None] & valid[:, None, None, :]
        x = x + _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        q, k, v = self.qkv(3, x)
        x = x + _merge(F.gelu(q @ k.transpose(-2, -1)) / L @ v) * valid[..., None]
        valid2 = torch.arange(L2, device=y.device)[None, :] < lengths2[:, None]
        q, k, v = self.qkv(4, y)
        y = y + _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=valid2[:, None, None, :]))
        return x, y


class MaskSites(_Sites):
    """Two padded SDPA and a block-diagonal SDPA over one bool key mask with holes (kv_mask)."""

    def __init__(self):
        super().__init__(3)

    def forward(self, x, mask):
        keys = mask[:, None, None, :]
        for i in range(2):
            q, k, v = self.qkv(i, x)
            x = x + _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keys))
        i = torch.arange(L, device=x.device)
        block = (i // BS)[:, None] == (i // BS)[None, :]
        q, k, v = self.qkv(2, x)
        return x + _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=block[None, None] & keys))


def length_inputs(seed=0, device="cpu", lengths=(L, 5, 0), lengths2=(7, L2, 1)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, E, generator=g).to(device).requires_grad_()
    y = torch.randn(B, L2, E, generator=g).to(device).requires_grad_()
    return x, torch.tensor(lengths, device=device), y, torch.tensor(lengths2, device=device)


def mask_inputs(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.4
    mask[:, 0] = True
    mask[1, BS:] = False  # a whole block without keys
    return torch.randn(B, L, E, generator=g).to(device).requires_grad_(), mask.to(device)


def _compiled(model, graphs: dict):
    """The model through gemcompile's pre-grad passes and aot_eager; ``graphs`` gets the fw / bw graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs):
        run_pre_grad(gm, instantiate(PIPELINE, GemConfig()), example_inputs)
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))(gm, example_inputs)

    return torch.compile(model, backend=backend)


def step(fn, inputs):
    """Outputs and input gradients of one forward + backward."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [t for t in inputs if t.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(sum(o.square().sum() for o in outs), leaves)


def _derived_nodes(gm) -> list[str]:
    return [n.target.overloadpacket.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "gemcompile"
            and n.target.overloadpacket.__name__ in DERIVED]


def _assert_same(got, want, exact=False):
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(a, b, **({"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}))


def test_one_order_per_lengths_tensor_per_step_and_fresh_after_an_in_place_change():
    torch.manual_seed(0)
    model, graphs = LengthSites(), {}
    compiled = _compiled(model, graphs)
    inputs = length_inputs()
    step(compiled, inputs)  # compiles forward and backward
    assert _derived_nodes(graphs["fw"]) == ["length_order", "length_order"]  # lengths, lengths2
    assert _derived_nodes(graphs["bw"]) == []  # the backward ops read the saved orders
    lo.reset_counts()
    got = step(compiled, inputs)
    assert dict(lo.COUNTS) == {"order": 2}  # five attention ops, forward and backward: two orders
    _assert_same(got, step(model, inputs))
    # the lengths change in place between steps: the next step orders (and attends) by the new values
    inputs[1][1], inputs[3][0] = 11, 0
    lo.reset_counts()
    got = step(compiled, inputs)
    assert dict(lo.COUNTS) == {"order": 2}
    _assert_same(got, step(model, inputs))


def test_one_key_bounds_per_mask_per_step():
    torch.manual_seed(0)
    model, graphs = MaskSites(), {}
    compiled = _compiled(model, graphs)
    inputs = mask_inputs()
    step(compiled, inputs)
    assert _derived_nodes(graphs["fw"]) == ["key_bounds"]  # jagged and block sites share it
    assert _derived_nodes(graphs["bw"]) == []
    lo.reset_counts()
    got = step(compiled, inputs)
    assert dict(lo.COUNTS) == {"bounds": 1, "order": 1}
    _assert_same(got, step(model, inputs))


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on a machine without CUDA (conftest sets TRITON_INTERPRET=1)")
def test_triton_launchers_take_the_shared_tensors_and_give_the_same_bits(monkeypatch):
    """The rewritten graph with the ops' Triton launchers on CPU (interpreter): with sharing, the launchers
    derive nothing (the only orders are the graph's, one per lengths); without it (the rewrite of before),
    each call derives its own; outputs and gradients are bitwise equal. (Given key bounds: the launcher tests
    of tests/unit/test_length_order_triton.py.)"""
    pytest.importorskip("triton")
    import gemcompile.passes.attention.rewrite as rewrite
    from gemcompile.lowering.block_attention import op as block_op
    from gemcompile.lowering.gdpa import op as gdpa_op
    from gemcompile.lowering.jagged_attention import op as jagged_op

    for module in (jagged_op, gdpa_op, block_op):
        monkeypatch.setattr(module, "use_triton", lambda q: q.dtype != torch.float64)
    torch.manual_seed(0)
    model = LengthSites()
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(rewrite, "share_derived_tensors", lambda graph: 0)
        torch._dynamo.reset()
        compiled = _compiled(model, {})
        inputs = length_inputs()
        step(compiled, inputs)
        lo.reset_counts()
        runs[shared] = step(compiled, inputs), dict(lo.COUNTS)
    assert runs[True][1] == {"order": 2}
    # before: every jagged call derives its order forward and backward, the GDPA call once forward and twice
    # backward (the query loop's order by the same lengths)
    assert runs[False][1] == {"order": 3 * 2 + 3}
    _assert_same(runs[True][0], runs[False][0], exact=True)
    _assert_same(runs[True][0], step(model, length_inputs()))


def test_unpad_regions_over_one_lengths_tensor_share_one_valid_token_index():
    """Two packed regions (two inputs, one lengths tensor) read one valid-token index: one host read of the
    token count per step, saved for the backward."""
    from tests.integration.test_unpad_pass import D_IN, N, MaskedResidualFfn

    class TwoStreams(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = MaskedResidualFfn(), MaskedResidualFfn()

        def forward(self, x, y, lengths):
            return self.a(x, lengths) + self.b(y, lengths)

    torch.manual_seed(0)
    model, graphs = TwoStreams(), {}
    compiled = _compiled(model, graphs)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, N, D_IN, generator=g, requires_grad=True) for _ in range(2))
    for lengths in ([9, 0, 3, 5], [1, 2, 8, 4]):
        inputs = (x, y, torch.tensor(lengths))
        _assert_same(step(compiled, inputs), step(model, inputs))

    def indices(gm):
        return [n for n in gm.graph.nodes if "valid_token_index" in str(n.target)]

    assert len(indices(graphs["fw"])) == 1 and indices(graphs["bw"]) == []
