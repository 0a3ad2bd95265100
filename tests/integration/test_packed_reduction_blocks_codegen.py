"""passes/packed_reduction_blocks.py inside a real compile: Inductor's Triton code generation, run on the CPU
(``cpu_backend="triton"``) as far as the kernels' source, with every kernel's config decision recorded.

The sums over packed tokens that unpad_reductions pads to their static bound (torch 2.11's path) read the
packed buffers over the padded range, so the read itself looks static; the fixed config must still reach
every one of them. Near misses: the same model under plain torch.compile (no recorded token counts) and
gemcompile's kernels that are not outer reductions get Inductor's own choice."""

from __future__ import annotations

import pytest
import torch

from gemcompile import GemConfig
from gemcompile.backend import GemBackend
from gemcompile.config import UnpadConfig
from gemcompile.passes import packed_reduction_blocks

from test_packed_size_hints import B, D, L, Block  # noqa: E402  (tests/integration is on sys.path)


class _NotRun(Exception):
    """Raised by the stub kernels: the test needs the generated code, not its run (no GPU here)."""


def _decisions(monkeypatch, backend) -> list[tuple[str, bool, dict | None]]:
    """(reduction hint, reads a data-dependent size, fixed config) for every kernel of forward and backward."""
    import torch.utils._triton as torch_triton
    from torch._inductor import async_compile

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
    return seen


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


@pytest.mark.slow
def test_padded_sums_over_packed_tokens_get_the_static_config(monkeypatch):
    seen = _decisions(monkeypatch, GemBackend(GemConfig(unpad=UnpadConfig(pad_reductions=True))))
    outer = [(dd, config) for hint, dd, config in seen if hint == "ReductionHint.OUTER"]
    # forward+backward: the bias gradients of the four Linears over packed tokens at least
    assert len(outer) >= 4
    assert all(dd for dd, _ in outer), "a padded sum over packed tokens was not seen as reading them"
    assert all(config is not None and config["R0_BLOCK"] > 1 for _, config in outer)
    assert all(config is None for hint, _, config in seen if hint != "ReductionHint.OUTER")


@pytest.mark.slow
def test_plain_torch_compile_is_left_to_inductor(monkeypatch):
    seen = _decisions(monkeypatch, "inductor")
    assert seen, "no kernel was generated"
    assert all(config is None for _, _, config in seen)
