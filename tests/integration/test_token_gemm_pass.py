"""token_gemm (post-grad): the GEMMs over a packed token count become gemcompile::token_mm, in the forward
(rows: tokens) and the backward (dgrad rows, and weight gradients summed over tokens), with eager's outputs
and gradients over token counts that split and ones that do not, and no recompiles. Static shapes (unpad
off) and the pass turned off are left alone."""

import re

import pytest
import torch
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain
from tests.integration.test_unpad_pass import LENGTH_SETS, MaskedResidualFfn, x_only
from tests.integration.test_unpad_reductions import _train_and_compare_uncached as _train_and_compare

# windows of 2 tokens and up: the tests' few tokens (up to 36) split as medium's 260k do
SMALL = {"per_octave": 2, "min_rows": 2}


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """A graph served from Inductor's or AOTAutograd's cache is not compiled, so the pass does not count."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def test_packed_gemms_bucketed_with_eager_gradients():
    model = MaskedResidualFfn()
    _train_and_compare(model, GemConfig(token_gemm=SMALL))
    # forward: the input projection and the two FFNs' up and down (5 addmm over T rows); backward: the
    # dgrads over T rows (4: the input projection's needs none) and the 5 weight gradients summed over T
    assert counters["gemcompile"]["token_gemm"] == 2  # one report per graph: forward, backward
    report = explain(model, *x_only(torch.tensor(LENGTH_SETS[0])), config=GemConfig(token_gemm=SMALL))
    forward, backward = [r.metrics for r in report.rewrites if r.pass_name == "token_gemm"]
    assert forward == {"gemms": 5, "token_rows": 5, "token_sums": 0}
    assert backward == {"gemms": 9, "token_rows": 4, "token_sums": 5}


def test_default_sizes_match_eager():
    """The default windows (256 tokens and up): these token counts run as one GEMM each, same results."""
    _train_and_compare(MaskedResidualFfn(), GemConfig())
    assert counters["gemcompile"]["token_gemm"] == 2


def test_static_shapes_left_alone():
    model = MaskedResidualFfn()
    _train_and_compare(model, GemConfig(unpad={"enabled": False}, token_gemm=SMALL))
    assert counters["gemcompile"]["token_gemm"] == 0


def test_turned_off():
    _train_and_compare(MaskedResidualFfn(), GemConfig(token_gemm={"enabled": False}))
    assert counters["gemcompile"]["token_gemm"] == 0


@pytest.mark.parametrize("unpad", [True, False])
def test_sizes_symbolic_by_the_batch_shape_alone_are_left_alone(unpad):
    """Under dynamic shapes B * N is symbolic but recurs from batch to batch (cuBLAS caches it): only unpad's
    data-dependent token count makes token_mm; with unpad off, no GEMM becomes one."""
    from tests.integration.test_unpad_dynamic_shapes import LengthsEncoder, _dynamic_inputs

    config = GemConfig(unpad={"enabled": unpad}, token_gemm=SMALL)
    report = explain(LengthsEncoder(), *_dynamic_inputs("lengths_with_last_token"), config=config)
    rewrites = [r for r in report.rewrites if r.pass_name == "token_gemm"]
    if not unpad:
        assert rewrites == [], [r.reason for r in rewrites]
        return
    assert len(rewrites) == 2 and all(r.metrics["gemms"] > 0 for r in rewrites)
    # the token counts split are unpad's (unbacked u0, ...), never the batch's symbolic s0 * s1
    symbols = [s for r in rewrites for s in re.findall(r"'([^']*)'", r.before)]
    assert symbols and all(re.fullmatch(r"u\d+", s) for s in symbols), [r.before for r in rewrites]
