"""How the Triton kernels of every op are launched: the interpreter switch and a launcher that asks the
autotuner once per tuning key, then launches the compiled kernel directly.

``INTERPRET``: TRITON_INTERPRET=1 (the CPU tests set it) runs the kernels in Triton's interpreter; the kernel
files then keep one small config per kernel so that the tests stay fast.

Host time is what a small attention call costs (an op call is ~0.2-0.4 ms of host time against tens of
microseconds of GPU time at SASRec/BERT sizes, benchmarks/results/op_host_time-20261202-024518.json), and
``JITFunction.run`` took 40-50 us of it per launch on the H200 machine (triton 3.6) where the compiled kernel's
own launcher took 15-20 us. So a launch whose specialization was seen before goes straight to the compiled
kernel (:func:`_specialization` says what must match), and anything new goes through ``JITFunction.run``.
GEMCOMPILE_DIRECT_LAUNCH=0 turns the direct path off.

Compile time is what a new tuning key costs: the autotuner compiles its configs one after the other inside
its timing loop (about 1-2 s each for an attention kernel at sm_90, ptxas included), so before it times them,
:func:`launch` compiles all of them at once in a thread pool through Triton's ``AsyncCompileMode``. Most of a
compile runs outside the GIL: on a 2-core CPU, four configs of the jagged forward kernel for sm_90 compiled
in 2.2 s in a pool of four threads, four others in 5.1 s one after the other. GEM-ref medium compiled in
125 s on the H200 before (benchmarks/results/e2e-medium-fill0.5-20261203-061809.json), 103 s after (-090042).
:func:`autotune` is ``triton.autotune`` with a shorter timing per config (:func:`tuning_bench`). ``TUNING``
counts the keys tuned and the seconds spent, for the e2e benchmark's compile-time report.
GEMCOMPILE_PARALLEL_TUNING=0 turns the thread pool off.
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from gemcompile.env import env_flag

try:  # Triton >= 3.4
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # pragma: no cover - older Triton compiles the configs inside the autotuner, one by one
    AsyncCompileMode = None

__all__ = ["DIRECT_LAUNCH", "INTERPRET", "PARALLEL_TUNING", "TUNING", "autotune", "launch", "tuning_bench"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DIRECT_LAUNCH = not INTERPRET and env_flag("GEMCOMPILE_DIRECT_LAUNCH", True)
"""Launch a seen specialization through its CompiledKernel (see the module docstring)."""

PARALLEL_TUNING = (not INTERPRET and AsyncCompileMode is not None
                   and env_flag("GEMCOMPILE_PARALLEL_TUNING", True))
"""Compile a new tuning key's configs in a thread pool before the autotuner times them."""


@dataclass
class TuningTotals:
    """What the autotuner cost this process (first launches of a tuning key, compile included)."""

    keys: int = 0
    """Tuning keys tuned."""
    seconds: float = 0.0
    """Wall time of those first launches: compiling every config, timing them, the launch."""
    compile_seconds: float = 0.0
    """Of which the parallel compile of the configs (0 when PARALLEL_TUNING is off)."""
    by_kernel: dict = field(default_factory=dict)
    """Kernel name -> [keys tuned, seconds, configs timed] (configs after pruning, summed over its keys)."""


TUNING = TuningTotals()

_EXECUTOR: ThreadPoolExecutor | None = None


def tuning_bench(kernel_call, quantiles):
    """The autotuner's timing of one config: Triton's ``do_bench`` with 5 ms of warm-up and 25 ms of
    measurement instead of 25 and 100, a fifth of the time (a kernel of 1 ms still runs 25 times; the
    median is kept)."""
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def autotune(configs, key, **kwargs):
    """``triton.autotune`` with :func:`tuning_bench` as the timing of a config."""
    import triton

    return triton.autotune(configs=configs, key=key, do_bench=tuning_bench, **kwargs)


def _compile_configs(kernel, grid, args: tuple, consts: dict) -> None:
    """Compile every config the autotuner will time for this launch, in parallel (``Autotuner.warmup``
    under ``AsyncCompileMode``: each compile runs in the pool, the kernels land in the JIT cache that the
    timing then hits). A config that fails to compile is left to the autotuner, which reports it."""
    global _EXECUTOR
    if not PARALLEL_TUNING or len(getattr(kernel, "configs", ())) < 2 or not hasattr(kernel, "warmup"):
        return
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1),
                                       thread_name_prefix="gemcompile-tuning")
    try:
        with AsyncCompileMode(_EXECUTOR, ignore_errors=True):
            if any(c.pre_hook is not None for c in kernel.configs):
                _warmup_with_hooks(kernel, grid, args, consts)
            else:
                kernel.warmup(*args, grid=grid, **consts)
    except Exception as e:  # noqa: BLE001  a speed-up only: the autotuner then compiles (and reports) them
        warnings.warn(f"gemcompile: compiling {getattr(kernel, 'base_fn', kernel)!r}'s configs in parallel "
                      f"failed ({type(e).__name__}: {e}); the autotuner compiles them one by one",
                      stacklevel=3)


def _warmup_with_hooks(kernel, grid, args: tuple, consts: dict) -> None:
    """``Autotuner.warmup`` that runs each config's pre_hook first: a TMA config's hook sets the descriptors'
    boxes, which the compiled kernel is specialized on (common/ragged_tma.py)."""
    kernel.nargs = dict(zip(kernel.arg_names, args))
    try:
        configs = kernel.prune_configs(consts)
    finally:
        kernel.nargs = None
    for config in configs:
        _run_pre_hook(kernel, config, args, consts)
        kernel.fn.warmup(*args, grid=grid, **consts, **config.all_kwargs())


_ARG_POSITIONS: dict = {}
"""id(a kernel's arg_names) -> (the names, name -> position): read once per kernel."""


def _run_pre_hook(kernel, config, args: tuple, consts: dict) -> None:
    """The config's pre_hook with the launch's named arguments, as the autotuner calls it (the launches that
    bypass the autotuner must too: a TMA config's hook sets the descriptors' boxes). A hook that lists the
    names it reads (``needs``) gets only those: the dict of all ~60 arguments cost ~10 us of host time."""
    hook = config.pre_hook
    if hook is None:
        return
    needs = getattr(hook, "needs", None)
    if needs is None:
        hook({**dict(zip(kernel.arg_names, args)), **consts, **config.all_kwargs()})
        return
    entry = _ARG_POSITIONS.get(id(kernel.arg_names))
    if entry is None or entry[0] is not kernel.arg_names:
        entry = _ARG_POSITIONS[id(kernel.arg_names)] = (kernel.arg_names,
                                                        {n: i for i, n in enumerate(kernel.arg_names)})
    positions = entry[1]
    named = {}
    for name in needs:
        i = positions.get(name, len(args))
        named[name] = args[i] if i < len(args) else consts.get(name, config.kwargs.get(name))
    hook(named)


_BEST_CONFIG: dict = {}
"""(kernel, tuning key) -> (the kernel's config list, the config the autotuner chose from it)."""

_COMPILED: dict = {}
"""(tuning key, device, specialization) -> (config list, the compiled kernel, its parameter names after the positional
arguments with their values from the constexprs and the config, in order)."""


def _current_device() -> int:
    """The current CUDA device, which Triton launches on (and keys its own caches by)."""
    return torch.cuda.current_device()


_NOT_SPECIALIZED: dict = {}
"""id(a kernel's params) -> (the params, one do_not_specialize flag per parameter): read once per kernel."""

_I32_MIN, _I32_END, _U64_START = -(2 ** 31), 2 ** 31, 2 ** 63


def _fixed_flags(params, n: int) -> tuple:
    """Whether each of the first ``n`` parameters is in the kernel's ``do_not_specialize`` (False past the
    end of ``params``), cached per params list."""
    entry = _NOT_SPECIALIZED.get(id(params))
    if entry is None or entry[0] is not params or len(entry[1]) < n:
        flags = tuple(getattr(p, "do_not_specialize", False) for p in params)
        entry = _NOT_SPECIALIZED[id(params)] = (params, flags + (False,) * max(0, n - len(flags)))
    return entry[1]


def _specialization(args: tuple, params=()) -> tuple:
    """What Triton specializes a kernel on, per positional argument, never less (a stricter key only sends
    more launches the slow way): a tensor's 16-byte alignment (its dtype is in the tuning key), an int's
    value 1, divisibility by 16 and width (i32 / i64 / u64), None; floats and bools are not specialized.
    An int among the kernel's ``do_not_specialize`` (``params``: its KernelParams) counts by width only.
    Runs on every launch (host time): one pass, the type tested by identity first."""
    key = []
    append = key.append
    for a, fixed in zip(args, _fixed_flags(params, len(args))):
        kind = type(a)
        if kind is int or (kind is not bool and isinstance(a, int)):
            width = (_I32_MIN <= a < _I32_END, a >= _U64_START)
            append(width if fixed else (a == 1, a % 16 == 0, *width))
        elif kind is bool or a is None:
            append(a)
        elif isinstance(a, torch.Tensor):
            append(a.data_ptr() % 16 == 0)
        else:
            append(kind)
    return tuple(key)


def _trailing_values(fn, n_positional: int, named: dict) -> list:
    """Values of the kernel's parameters after the first ``n_positional``, in order: named ones from
    ``named`` (constexprs, the tuned config's block sizes), the rest their defaults."""
    values = []
    for param in fn.params[n_positional:]:
        if param.name in named:
            values.append(named[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            raise TypeError(f"{fn.__name__}: no value for parameter {param.name}")
    return values


def launch(kernel, grid, args: tuple, consts: dict, buckets: tuple[int, ...]) -> None:
    """Launch an autotuned kernel. The first launch of a tuning key goes through the autotuner; later ones
    go to the tuned kernel with the config it chose: through ``JITFunction.run`` for a specialization not
    seen yet (the autotuner itself rebuilds dicts of all ~45 arguments on every launch, about 0.1 ms of host
    time per launch on the H200 machine's CPU), straight to the compiled kernel for one seen before.

    The key holds what the autotuner keys on: the values of the kernel's autotune-key arguments (the
    length ``buckets`` and the flags, passed in ``consts`` with the other constexprs) and the dtypes of the
    tensor arguments."""
    key = (kernel, *buckets, *consts.values(), *(a.dtype for a in args if isinstance(a, torch.Tensor)))
    tuned = _BEST_CONFIG.get(key)
    if tuned is None or tuned[0] is not kernel.configs:  # (tests pin configs by replacing the list)
        start = time.perf_counter()
        _compile_configs(kernel, grid, args, consts)
        TUNING.compile_seconds += time.perf_counter() - start
        kernel.configs_timings = None  # set again by the autotuner only when it times more than one config
        kernel[grid](*args, **consts)
        _BEST_CONFIG[key] = (kernel.configs, kernel.best_config)
        seconds = time.perf_counter() - start
        TUNING.keys += 1
        TUNING.seconds += seconds
        name = getattr(getattr(kernel, "base_fn", None), "__name__", None) or repr(kernel)
        entry = TUNING.by_kernel.setdefault(name, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += len(getattr(kernel, "configs_timings", None) or ()) or 1
        return
    config = tuned[1]
    _run_pre_hook(kernel, config, args, consts)
    direct = DIRECT_LAUNCH and hasattr(kernel.fn, "params")  # a JITFunction (not a heuristics wrapper)
    if direct:
        # per device, as Triton's own caches: a compiled kernel's function handle belongs to one device
        spec = (key, _current_device(), _specialization(args, kernel.fn.params))
        seen = _COMPILED.get(spec)
        if seen is not None and seen[0] is kernel.configs:
            _, compiled, trailing = seen
            values = (*args, *trailing)
            g = grid(dict(zip(kernel.fn.arg_names, values))) if callable(grid) else grid
            compiled[(*g, *(1,) * (3 - len(g)))](*values)
            return
    compiled = kernel.fn.run(*args, grid=grid, warmup=False, **consts, **config.all_kwargs())
    if direct and compiled is not None and hasattr(compiled, "__getitem__"):
        named = {**consts, **config.kwargs}
        _COMPILED[spec] = (kernel.configs, compiled, _trailing_values(kernel.fn, len(args), named))
