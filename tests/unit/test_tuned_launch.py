"""common/tuned_launch.launch: autotune once per key, then JITFunction.run for a specialization not seen yet
and the compiled kernel directly for one seen before (no GPU: the kernel objects are stand-ins that record
how they were called; the parameter list is a real triton.jit function's)."""

import inspect

import pytest
import torch
import triton
import triton.language as tl

from gemcompile.lowering.common import tuned_launch


from triton.runtime.jit import JITFunction  # noqa: E402


def _source(x_ptr, y_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    pass


_kernel = JITFunction(_source)  # a JITFunction even under TRITON_INTERPRET=1 (whose triton.jit gives another)


class _Compiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *values: self.calls.append(("direct", grid, values))


class _Fn:
    """JITFunction.run recorded; the parameters are _kernel's."""

    def __init__(self, calls):
        self.calls, self.params, self.arg_names = calls, _kernel.params, _kernel.arg_names

    def run(self, *args, grid, warmup, **kwargs):
        self.calls.append(("run", args, kwargs))
        return _Compiled(self.calls)


class _Tuner:
    def __init__(self):
        self.calls = []
        self.fn = _Fn(self.calls)
        self.configs = [triton.Config({"BLOCK": 16}, num_warps=2)]
        self.best_config = None

    def __getitem__(self, grid):
        def tune(*args, **consts):
            self.calls.append(("autotune", args, consts))
            self.best_config = self.configs[0]
        return tune


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(tuned_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(tuned_launch, "_BEST_CONFIG", {})
    monkeypatch.setattr(tuned_launch, "_COMPILED", {})
    monkeypatch.setattr(tuned_launch, "_current_device", lambda: _DEVICE[0])


_DEVICE = [0]


def _grid(meta):
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


def test_autotune_then_run_then_direct_with_every_parameter_in_order(direct):
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        tuned_launch.launch(tuner, _grid, (x, y, 40, 0.5), {"FLAG": True}, (64,))
    assert [c[0] for c in tuner.calls] == ["autotune", "run", "direct"]
    _, grid, values = tuner.calls[2]
    assert grid == (3, 1, 1)  # cdiv(40, BLOCK 16), padded to three dims
    assert values == (x, y, 40, 0.5, True, 16, 3)  # positional, the constexpr, the config's block, a default
    assert tuner.calls[1][2] == {"FLAG": True, **tuner.configs[0].all_kwargs()}


@pytest.mark.parametrize("change", ["misaligned", "int_one", "int_width", "int_divisibility"])
def test_a_new_specialization_goes_through_run_again(direct, change):
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    args = (x, y, 32, 0.5)
    for _ in range(3):
        tuned_launch.launch(tuner, _grid, args, {"FLAG": False}, (64,))
    other = {"misaligned": (x[1:], y, 32, 0.5), "int_one": (x, y, 1, 0.5),
             "int_width": (x, y, 2 ** 33, 0.5), "int_divisibility": (x, y, 33, 0.5)}[change]
    tuned_launch.launch(tuner, _grid, other, {"FLAG": False}, (64,))
    tuned_launch.launch(tuner, _grid, other, {"FLAG": False}, (64,))
    assert [c[0] for c in tuner.calls] == ["autotune", "run", "direct", "run", "direct"]
    tuned_launch.launch(tuner, _grid, args, {"FLAG": False}, (64,))  # the first one is still cached
    assert tuner.calls[-1][0] == "direct" and tuner.calls[-1][2][0] is x


def test_floats_are_not_specialized_and_tuning_keys_are_separate(direct):
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    for scale in (0.5, 0.25, 0.125):
        tuned_launch.launch(tuner, _grid, (x, y, 32, scale), {"FLAG": False}, (64,))
    assert [c[0] for c in tuner.calls] == ["autotune", "run", "direct"]
    assert tuner.calls[-1][2][3] == 0.125
    tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (128,))  # another bucket: autotune
    assert tuner.calls[-1][0] == "autotune"


def test_another_device_compiles_its_own(direct):
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    try:
        for device in (0, 0, 0, 1, 1, 0):
            _DEVICE[0] = device
            tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    finally:
        _DEVICE[0] = 0
    assert [c[0] for c in tuner.calls] == ["autotune", "run", "direct", "run", "direct", "direct"]


def test_switched_off_every_launch_runs(monkeypatch, direct):
    monkeypatch.setattr(tuned_launch, "DIRECT_LAUNCH", False)
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    for _ in range(4):
        tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    assert [c[0] for c in tuner.calls] == ["autotune", "run", "run", "run"]


def test_pinned_configs_retune(direct):
    tuner, x, y = _Tuner(), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    tuner.configs = [triton.Config({"BLOCK": 32}, num_warps=4)]  # a test pins another config list
    tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    tuned_launch.launch(tuner, _grid, (x, y, 32, 0.5), {"FLAG": False}, (64,))
    assert [c[0] for c in tuner.calls][3:] == ["autotune", "run", "direct"]
    assert tuner.calls[-1][2][5] == 32


def test_every_op_with_triton_kernels_has_its_cuda_kernel_at_the_cuda_key():
    """opkit.cuda_kernel registers straight at the CUDA key (no register_kernel wrappers): each op that the
    Triton kernels serve must still have a CUDA kernel, or CUDA calls would fall to the reference."""
    import gemcompile.lowering  # noqa: F401

    for name in ("jagged_attention_fwd", "jagged_attention_bwd", "gdpa_fwd", "gdpa_bwd", "block_attention_fwd",
                 "block_attention_bwd", "fp8_mm"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gemcompile::{name}", "CUDA"), name
        assert "opkit.py" in torch._C._dispatch_dump(f"gemcompile::{name}").split("CUDA: registered at ")[1]


class _TunerWithConfigs(_Tuner):
    """Two configs and Autotuner.warmup's contract: under AsyncCompileMode each config's compile is submitted
    to the mode's pool; the kernel is filed (finalized) when the mode exits."""

    def __init__(self):
        super().__init__()
        self.configs = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 32}, num_warps=4)]
        self.filed = []

    def warmup(self, *args, grid, **consts):
        from triton.runtime._async_compile import active_mode

        mode = active_mode.get()
        self.calls.append(("warmup", mode is not None, consts))
        extra = (lambda kernel: None,) * ("cleanup_fn" in inspect.signature(mode.submit).parameters)  # 3.9
        for config in self.configs:
            mode.submit(str(config), lambda c=config: c.kwargs["BLOCK"], self.filed.append, *extra)

    def __getitem__(self, grid):
        tune = super().__getitem__(grid)

        def after_compiles(*args, **consts):
            self.calls.append(("filed before timing", sorted(self.filed)))
            tune(*args, **consts)
        return after_compiles


@pytest.mark.skipif(tuned_launch.AsyncCompileMode is None, reason="this Triton has no AsyncCompileMode")
def test_a_new_key_compiles_its_configs_in_the_pool_before_the_autotuner_times_them(monkeypatch, direct):
    monkeypatch.setattr(tuned_launch, "PARALLEL_TUNING", True)
    monkeypatch.setattr(tuned_launch, "TUNING", tuned_launch.TuningTotals())
    tuner, x, y = _TunerWithConfigs(), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        tuned_launch.launch(tuner, _grid, (x, y, 40, 0.5), {"FLAG": True}, (64,))
    assert [c[0] for c in tuner.calls] == ["warmup", "filed before timing", "autotune", "run", "direct"]
    assert tuner.calls[0][1:] == (True, {"FLAG": True})  # inside the mode, with the launch's constexprs
    assert tuner.calls[1][1] == [16, 32]  # every config compiled and filed before the autotuner runs
    totals = tuned_launch.TUNING
    assert totals.keys == 1 and totals.seconds >= totals.compile_seconds
    (keys, seconds, _), = totals.by_kernel.values()  # one kernel, one key, its seconds
    assert keys == 1 and seconds == pytest.approx(totals.seconds)


def test_without_the_pool_the_autotuner_compiles_alone(monkeypatch, direct):
    monkeypatch.setattr(tuned_launch, "PARALLEL_TUNING", False)
    tuner, x, y = _TunerWithConfigs(), torch.zeros(64), torch.zeros(64)
    tuned_launch.launch(tuner, _grid, (x, y, 40, 0.5), {"FLAG": True}, (64,))
    assert [c[0] for c in tuner.calls] == ["filed before timing", "autotune"]


def test_small_ops_called_every_step_have_their_own_impl_at_the_cuda_key():
    """opkit.direct_cuda: token_mm, the order/bounds ops, the table lookups and relative_bias run their own
    implementation at the CUDA key (no register_kernel wrapper on every call of a compiled step)."""
    import gemcompile.lowering  # noqa: F401

    for name in ("token_mm", "length_order", "key_bounds", "sparse_embedding", "sparse_embedding_bags",
                 "relative_bias"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gemcompile::{name}", "CUDA"), name
        dump = torch._C._dispatch_dump(f"gemcompile::{name}")
        assert "opkit.py" in dump.split("CUDA: registered at ")[1], name


@pytest.mark.skipif(tuned_launch.AsyncCompileMode is None, reason="this Triton has no AsyncCompileMode")
def test_a_failing_parallel_compile_warns_and_the_autotuner_still_runs(monkeypatch, direct):
    monkeypatch.setattr(tuned_launch, "PARALLEL_TUNING", True)
    tuner, x, y = _TunerWithConfigs(), torch.zeros(64), torch.zeros(64)

    def broken(*args, **kwargs):
        raise RuntimeError("no driver")
    tuner.warmup = broken
    with pytest.warns(UserWarning, match="one by one"):
        tuned_launch.launch(tuner, _grid, (x, y, 40, 0.5), {"FLAG": True}, (64,))
    assert [c[0] for c in tuner.calls] == ["filed before timing", "autotune"]
