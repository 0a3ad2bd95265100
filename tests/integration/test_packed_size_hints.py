"""Inductor's scheduler heuristics see unpad's packed (T, ...) tensors at their hinted size
(passes/packed_size_hints.py), on a torch whose Inductor does not read unbacked hints (2.11, simulated
here on any torch by leaving the hints out of the shape env, as valid_tokens does there).

One small packed model compiled with Inductor on the CPU, forward and backward: the buffer sizes the
peak-memory reordering computes in each graph (the forward's packed activations, the backward's packed
saved inputs) against their numel at the recorded hint, and the kernels the scheduler fuses (without the
hints, no two kernels sharing only packed buffers fuse)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import GemConfig
from gemcompile.backend import GemBackend
from gemcompile.lowering import valid_tokens
from gemcompile.passes import packed_size_hints
from gemcompile.passes.packed_size_hints import hinted_value

B, L, D, H = 4, 32, 32, 2


class Block(nn.Module):
    """Attention over key lengths with token-wise layers around it: unpad packs the tokens."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.ffn = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, lengths):
        q, k, v = (proj(x).view(B, L, H, D // H).transpose(1, 2) for proj in (self.q, self.k, self.v))
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, L, D)
        x = x + a
        x = x + self.ffn(x)
        valid = torch.arange(L)[None, :, None] < lengths[:, None, None]
        return (x * valid).sum()


def _compile_packed(monkeypatch, wrapped: bool) -> tuple[list[tuple[str, int, int]], list[int]]:
    """(kind, size the reordering used, size at the hint) for every packed buffer and graph input of the
    compiled forward and backward; the scheduler nodes each graph has after fusion."""
    from torch._inductor import ir, memory
    from torch._inductor import scheduler as inductor_scheduler
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    monkeypatch.setattr(valid_tokens, "inductor_reads_unbacked_hints", lambda: False)  # no hints in the env
    for owner, name in ((memory, "reorder_for_peak_memory"), (GraphLowering, "get_dep_size_hint")):
        current = getattr(owner, name)  # Inductor's own (an earlier compile may have installed the wrappers)
        monkeypatch.setattr(owner, name, current.__wrapped__ if packed_size_hints.is_wrapped(current) else current)
    monkeypatch.setattr(packed_size_hints, "inductor_reads_unbacked_hints", lambda: not wrapped)
    seen: list[tuple[str, int, int]] = []

    def at_hint(numel, dtype) -> int | None:
        hints = valid_tokens.recorded_hints(V.graph.sizevars.shape_env)
        value = hinted_value(numel, hints, V.graph.sizevars.simplify)
        return None if value is None else value * dtype.itemsize

    buffer_sizes, input_buffers = memory.compute_size_for_scheduler_buffer, memory.get_freeable_input_buf
    planning = memory.prepare_planning_info
    inside = []  # the reordering's own estimate only (codegen's buffer-reuse estimate calls the same helpers)

    def planning_spy(*args, **kwargs):
        inside.append(True)
        try:
            return planning(*args, **kwargs)
        finally:
            inside.pop()

    def buffers_spy(name_to_buf):
        sizes = buffer_sizes(name_to_buf)
        for name in name_to_buf if inside else ():
            buf = name_to_buf[name]
            if isinstance(buf.node.get_output_spec(), (ir.MultiOutputLayout, ir.NoneLayout)):
                continue  # sized through its outputs / no storage
            want = at_hint(buf.node.get_numel(), buf.node.get_dtype())
            if want is not None:
                seen.append(("buffer", sizes[name][1], want))
        return sizes

    def inputs_spy(nodes, graph_inputs):
        freeable = input_buffers(nodes, graph_inputs)
        for name, buf in freeable.items() if inside else ():
            node = V.graph.graph_inputs.get(name)
            want = None if node is None else at_hint(node.get_numel(), node.get_dtype())
            if want is not None:
                seen.append(("input", buf.mpi_buffer.size_free, want))
        return freeable

    monkeypatch.setattr(memory, "compute_size_for_scheduler_buffer", buffers_spy)
    monkeypatch.setattr(memory, "get_freeable_input_buf", inputs_spy)
    monkeypatch.setattr(memory, "prepare_planning_info", planning_spy)
    fused: list[int] = []
    fuse_nodes = inductor_scheduler.Scheduler.fuse_nodes

    def fuse_spy(self, nodes):
        out = fuse_nodes(self, nodes)
        fused.append(len(out))
        return out

    monkeypatch.setattr(inductor_scheduler.Scheduler, "fuse_nodes", fuse_spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(B, L, D, requires_grad=True)
    lengths = torch.tensor([32, 0, 17, 5])
    with torch._inductor.config.patch(fx_graph_cache=False, reorder_for_peak_memory=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(model, backend=GemBackend(GemConfig()))(x, lengths)
        out.backward()  # the backward compiles here
    torch.testing.assert_close(out, model(x, lengths))
    torch._dynamo.reset()
    return seen, fused


@pytest.fixture(scope="module")
def compiled():
    """Both compiles (with and without the wrappers), once for the module's tests."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        wrapped = _compile_packed(monkeypatch, wrapped=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        plain = _compile_packed(monkeypatch, wrapped=False)
    return wrapped, plain


@pytest.mark.slow
def test_reordering_sizes_packed_tensors_at_the_hint(compiled):
    (seen, _), _ = compiled
    kinds = {kind for kind, _, _ in seen}
    assert kinds == {"buffer", "input"}, seen  # packed buffers, and packed saved values entering the backward
    assert all(want > 0 and got == want for _, got, want in seen), [s for s in seen if s[1] != s[2]]


@pytest.mark.slow
def test_without_the_wrappers_packed_tensors_weigh_nothing(compiled):
    """The fault the wrappers mend, reproduced: without hints Inductor sizes every packed tensor at 0."""
    _, (seen, _) = compiled
    assert seen and all(got == 0 for _, got, _ in seen), seen


@pytest.mark.slow
def test_kernels_sharing_packed_buffers_fuse(compiled):
    """Without the hints the forward's kernels that share only packed buffers stay apart ("no shared data");
    with them the scheduler fuses them: fewer nodes after fusion, the backward no more."""
    (_, fused), (_, fused_plain) = compiled
    assert len(fused) == len(fused_plain) == 2, (fused, fused_plain)  # forward, backward
    assert fused[0] < fused_plain[0] and fused[1] <= fused_plain[1], (fused, fused_plain)


def test_hinted_value():
    import sympy

    u0, u1, s0 = sympy.symbols("u0 u1 s0", integer=True)
    hints = {u0: 100}
    assert hinted_value(u0 * 32, hints, lambda e: e) == 3200
    assert hinted_value(u1 * 32, hints, lambda e: e) is None  # no hint for that symbol
    assert hinted_value(u0 * s0, hints, lambda e: e) is None  # another symbol is left
    assert hinted_value(u1 * 2, hints, lambda e: e.xreplace({u1: u0})) == 200  # after a replacement
    assert hinted_value(sympy.Integer(7), hints, lambda e: e) is None  # nothing symbolic: Inductor's own
