"""passes/packed_reduction_blocks.py: the block config given to an outer reduction over packed tokens is
the one Inductor's own heuristic picks for the same reduction over static sizes (checked against
triton_heuristics._reduction_configs itself, num_dynamic 0 against 1); the wrapper leaves every kernel
alone outside a graph with unpad's token counts, and installs once."""

import types

import pytest

from gemcompile.passes import packed_reduction_blocks
from gemcompile.passes.packed_reduction_blocks import install, static_outer_config

triton_heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
from torch._inductor.runtime.hints import DeviceProperties, ReductionHint  # noqa: E402


def _inductor_configs(x, rnumel, loads, num_dynamic):
    device = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
                              max_threads_per_multi_processor=2048, warp_size=32)
    return triton_heuristics._reduction_configs(
        size_hints={"x": x, "r0_": rnumel}, num_dynamic=num_dynamic,
        inductor_meta={"reduction_hint": ReductionHint.OUTER, "num_load": loads, "num_reduction": 1},
        triton_meta={"device": device, "signature": {}})


@pytest.mark.parametrize("x", [256, 1024, 4096, 32768, 65536, 131072, 1 << 20])
@pytest.mark.parametrize("rnumel", [256, 2048, 8192])
@pytest.mark.parametrize("loads", [1, 2, 3, 4, 6])
def test_static_branch_of_inductors_heuristic(x, rnumel, loads):
    try:
        (static,) = _inductor_configs(x, rnumel, loads, num_dynamic=0)
    except TypeError as e:  # another torch's signature of the private heuristic
        pytest.skip(f"Inductor's _reduction_configs differs here: {e}")
    ours = static_outer_config(x, rnumel, loads)
    assert (ours["XBLOCK"], ours["R0_BLOCK"]) == (static.kwargs["XBLOCK"], static.kwargs["R0_BLOCK"])


def test_the_dynamic_branch_is_what_it_corrects():
    """One dynamic size and three or more loads: one row per loop iteration, the config this module replaces."""
    try:
        (dynamic,) = _inductor_configs(131072, 2048, 4, num_dynamic=1)
    except TypeError as e:
        pytest.skip(f"Inductor's _reduction_configs differs here: {e}")
    assert dynamic.kwargs["R0_BLOCK"] == 1
    assert static_outer_config(131072, 2048, 4)["R0_BLOCK"] == 64


def test_left_alone_outside_gemcompiles_graphs():
    assert install() and install()  # idempotent
    from torch._inductor.choices import InductorChoices

    kwargs = {"features": None}
    features = types.SimpleNamespace(is_reduction=lambda: True)
    # no graph being lowered (no V.graph): Inductor's own kwargs come back unchanged
    assert InductorChoices().triton_kernel_kwargs(None, features, [{"x": 1, "r0_": 1}], kwargs) == kwargs
    assert getattr(InductorChoices.triton_kernel_kwargs, packed_reduction_blocks._WRAPPED)


def test_fixed_config_kept_when_inductor_set_one():
    assert packed_reduction_blocks.packed_outer_config(types.SimpleNamespace(), [], {"fixed_config": object()}) is None


@pytest.mark.parametrize("x", [300, 384, 768, 1000, 5000, 100_000])
@pytest.mark.parametrize("rnumel", [65, 100, 777, 3000])
def test_sizes_that_are_not_powers_of_two_get_the_config_of_their_size_hints(x, rnumel):
    """Triton takes only power-of-two blocks and warps: GEM-ref tiny (and any model 384 or 768 wide) failed to
    compile its norm-gradient sums on the GPU ("num_warps must be a power of 2"). The config is the one
    Inductor's heuristic picks for the sizes rounded up to powers of two, its size hints."""
    def power_of_two(n):
        return n > 0 and n & (n - 1) == 0

    config = static_outer_config(x, rnumel, 4)
    assert all(power_of_two(config[k]) for k in ("XBLOCK", "R0_BLOCK", "num_warps")), config
    hints = (1 << (x - 1).bit_length(), 1 << (rnumel - 1).bit_length())
    assert config == static_outer_config(*hints, 4)
