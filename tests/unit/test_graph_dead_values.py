"""The dead values the pre-grad passes drop before they run (passes/base.run_pre_grad): pure values nobody
reads go (a pooler the caller ignores would count as a reader of padded rows), effects stay: in-place
updates (methods, ``x += y``, ``out=``), run-time checks, random draws."""

import operator

import torch
import torch.fx as fx

from gemcompile.passes.graph import erase_dead


def _graph():
    g = fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    kept = {
        "add_": g.call_method("add_", (buf, x)),
        "iadd": g.call_function(operator.iadd, (buf, x)),
        "out": g.call_function(torch.add, (x, x), {"out": buf}),
        "check": g.call_function(torch._check, (True,)),
        "assert": g.call_function(torch._assert_async, (x,)),
        "dropout": g.call_function(torch.nn.functional.dropout, (x, 0.5, True)),
    }
    pooled = g.call_function(torch.tanh, (g.call_function(operator.getitem, (x, (slice(None), 0))),))
    g.output(g.call_function(torch.relu, (x,)))
    return g, kept, pooled


def test_pure_dead_values_go_and_effects_stay():
    g, kept, pooled = _graph()
    erase_dead([n for n in g.nodes if not n.users])
    alive = set(g.nodes)
    assert pooled not in alive and not any(n.target is operator.getitem for n in g.nodes)  # and what only it read
    missing = [name for name, node in kept.items() if node not in alive]
    assert not missing, missing


def test_a_dead_pooler_is_not_compiled_away_from_the_answer():
    """Compiled with the pre-grad passes, a function whose unused values include an in-place update of an
    input still updates it, as eager does."""
    from tests.rewritten import rewritten

    def fn(x, buf):
        torch.tanh(x[:, 0])  # dead
        buf += x  # an effect, its result unused
        return x.relu()

    x = torch.randn(3, 4)
    buf, buf_ref = torch.zeros(3, 4), torch.zeros(3, 4)
    out = rewritten(fn)(x, buf)
    torch.testing.assert_close(out, fn(x, buf_ref))
    torch.testing.assert_close(buf, buf_ref)


def _vmapped_causal_mask(q, k, v):
    """transformers' masks (masking_utils._vmap_for_bhqkv): Dynamo records torch.vmap's nesting calls, whose
    results nobody reads; erased, the batched ops ran at levels that no longer exist."""
    fn = lambda b, h, i, j: i.new_ones((), dtype=torch.bool) & (j <= i)  # noqa: E731
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    n = q.shape[2]
    mask = fn(torch.arange(q.shape[0]), torch.arange(1), torch.arange(n), torch.arange(n))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_vmap_bookkeeping_without_users_is_kept():
    from tests.rewritten import rewritten

    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    torch.testing.assert_close(rewritten(_vmapped_causal_mask)(q, k, v), _vmapped_causal_mask(q, k, v))
