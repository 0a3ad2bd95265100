"""The Triton kernels Inductor generates for a packed model: run on the CPU (``cpu_backend="triton"``) as far
as the kernels' source, with every kernel's config decision and size hints recorded.

* passes/packed_reduction_blocks.py: the sums over packed tokens that unpad_reductions pads to their
  static bound (torch 2.11's path) read the packed buffers over the padded range, so the read itself looks
  static; the fixed config must still reach every one of them. Near misses: the same model under plain
  torch.compile (no recorded token counts), and kernels that are not outer reductions.
* Size hints: a kernel over packed rows is sized at unpad's recorded token count, not at Inductor's 8192
  fallback for sizes it cannot evaluate (torch 2.13 reads the hint; on 2.11 passes/packed_size_hints.py's
  codegen wrapper gives it)."""

from __future__ import annotations

import pytest
import torch
from test_packed_size_hints import B, Block, D, L  # noqa: E402  (tests/integration is on sys.path)

from gemcompile import GemConfig
from gemcompile.backend import GemBackend
from gemcompile.config import UnpadConfig
from gemcompile.passes import packed_reduction_blocks


class _NotRun(Exception):
    """Raised by the stub kernels: the test needs the generated code, not its run (no GPU here)."""


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _generate(monkeypatch, backend) -> tuple[list[tuple[str, bool, dict | None]], list[tuple[int, int]]]:
    """(reduction hint, reads a data-dependent size, fixed config) for every kernel of forward and backward;
    (x size hint in the source, next power of 2 of the x size at unpad's hints) for every kernel whose x size
    is data-dependent."""
    import re

    import torch.utils._triton as torch_triton
    from torch._inductor import async_compile
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from gemcompile.lowering.valid_tokens import recorded_hints
    from gemcompile.passes.packed_size_hints import hinted_value

    seen = []
    decide = packed_reduction_blocks.packed_outer_config

    def spy(features, groups, kwargs):
        config = decide(features, groups, kwargs)
        hint = str(features.get_reduction_hint()) if features.is_reduction() else "pointwise"
        seen.append((hint, packed_reduction_blocks._reads_data_dependent_sizes(features), config))
        return config

    class Stub:
        def __getattr__(self, name):
            def refuse(*args, **kwargs):
                raise _NotRun(name)
            return refuse

    sized = []
    codegen = TritonKernel.codegen_kernel  # gemcompile's wrapper where this torch needs it

    def codegen_spy(self, *args, **kwargs):
        source = codegen(self, *args, **kwargs)
        x = self.numels.get("x")
        if x is not None and free_unbacked_symbols(x):
            hints = recorded_hints(V.graph.sizevars.shape_env)
            at_hint = hinted_value(x, hints, V.graph.sizevars.simplify)
            found = re.search(r"size_hints=\{'x': (\d+)", source)
            sized.append((int(found.group(1)) if found else None,
                          None if at_hint is None else _next_power_of_2(at_hint)))
        return source

    monkeypatch.setattr(TritonKernel, "codegen_kernel", codegen_spy)
    monkeypatch.setattr(packed_reduction_blocks, "packed_outer_config", spy)
    monkeypatch.setattr(async_compile.AsyncCompile, "triton", lambda self, *a, **k: Stub())
    monkeypatch.setattr(torch_triton, "triton_hash_with_backend", lambda: "cpu-codegen-only")
    torch._dynamo.reset()
    model = Block()
    x = torch.randn(B, L, D, requires_grad=True)
    with torch._inductor.config.patch(cpu_backend="triton", fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
        packed_reduction_blocks.install()
        with pytest.raises(Exception) as raised:  # the forward's first kernel launch
            torch.compile(model, backend=backend)(x, torch.tensor([32, 0, 17, 5]))
    torch._dynamo.reset()
    assert any(isinstance(e, _NotRun) for e in _chain(raised.value)), raised.value
    return seen, sized


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


@pytest.mark.slow
def test_padded_sums_over_packed_tokens_get_the_static_config(monkeypatch):
    seen, _ = _generate(monkeypatch, GemBackend(GemConfig(unpad=UnpadConfig(pad_reductions=True))))
    outer = [(dd, config) for hint, dd, config in seen if hint == "ReductionHint.OUTER"]
    # forward+backward: the bias gradients of the four Linears over packed tokens at least
    assert len(outer) >= 4
    assert all(dd for dd, _ in outer), "a padded sum over packed tokens was not seen as reading them"
    assert all(config is not None and config["R0_BLOCK"] > 1 for _, config in outer)
    assert all(config is None for hint, _, config in seen if hint != "ReductionHint.OUTER")


@pytest.mark.slow
def test_plain_torch_compile_is_left_to_inductor(monkeypatch):
    seen, _ = _generate(monkeypatch, "inductor")
    assert seen, "no kernel was generated"
    assert all(config is None for _, _, config in seen)


@pytest.mark.slow
def test_kernels_over_packed_rows_are_sized_at_the_hint(monkeypatch):
    _, sized = _generate(monkeypatch, GemBackend(GemConfig()))
    assert len(sized) >= 4, "expected the packed layers' pointwise kernels"
    assert all(want is not None for _, want in sized), "a packed kernel's size has no recorded hint"
    assert [got for got, _ in sized] == [want for _, want in sized]
