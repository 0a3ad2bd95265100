"""`gemcompile bench e2e`: the GEM-ref training step under eager, torch.compile and gem_compile, side by side.

Every method trains a fresh GEM-ref (same seed, same synthetic batches, lengths varying per batch) for
``warmup + steps`` steps and reports, over the measured steps:

- samples/s and useful TFLOP/s (the section-8 formula of runtime/training/flops.py: valid tokens only,
  training = 3x forward) and MFU against the GPU's bf16 dense peak;
- compile time: the wall time of the warm-up steps minus warm-up x the median measured step (what the
  compilations cost beyond running those steps);
- recompiles after warm-up: Dynamo's count of compiled graphs, read before and after the measured steps
  (the warm-up holds at least two batch shapes, so automatic dynamic shapes settle inside it), and per
  measured step the Triton JIT compiles and the CUDA-graph captures in it (triton_compiles.py,
  graph_captures.py: CUDA-graph trees recording new size combinations under ``@reduce-overhead``);
- peak memory (CUDA) and the final NE over the last ``ne_window`` steps, with its relative gap to eager's
  NE on the same batches;
- on CUDA, the GPU's own time per step: the summed kernel time of ``kernel_steps`` more steps under
  torch.profiler (``kernel_ms_per_step``), the share of the step the host adds (``host_share``) and the
  MFU the step would reach at kernel time (``mfu_at_kernel_time``): what a host-bound step leaves; and
  where that time goes (``kernel_profile``: the largest kernels, kernels per step, ms per kernel class);
- with ``memory_snapshot=True`` (CUDA), what is alive at the GPU's peak: one more step after the measured
  ones (outside their timing) under torch's CUDA memory history (runtime/training/memory_snapshot.py),
  reduced to a few KB (``memory_snapshot``): the step's peak allocated bytes, what was alive before the step
  (weights, optimizer state; ``model_state`` counts them), and the live blocks at the peak grouped by their
  allocation's top user-level frame (an Inductor kernel buffer's wrapper line, a gemcompile line);
- with ``layers=True``, Meta's *local* MFU per layer: each GemLayer alone (its inputs captured from one
  eager step), forward + backward, compiled the method's way, timed with CUDA events, against its own
  useful FLOPs; no recomputation, no communication.

Methods: ``eager``, ``inductor`` (torch.compile default), ``inductor-sparse-grad`` (torch.compile with
torch's own sparse table gradients: ``sparse=True`` tables under torch's Adagrad, as nn.Embedding's
documentation offers for large tables), ``gem`` (gem_compile, default GemConfig, tables trained sparsely
by SparseAdagrad; ``gem-dense-tables`` keeps them dense),
``gem-no-<pass>`` (one default-on pass group off) and ``gem+<pass>`` (one default-off group on, e.g.
``gem+mxfp8``), named variants (VARIANTS) and the activation memory settings by name
(``gem-memory-budget-<fraction>[+fp8-saved]``, memory_variant); each but eager with an optional
``@reduce-overhead`` (CUDA graphs). The JSON written by ``gemcompile bench e2e --out`` feeds
benchmarks/render_report.py.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from gemcompile.config import GemConfig
from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
from gemcompile.runtime.training.config import DEFAULT_BATCH_SIZE
from gemcompile.runtime.training.flops import TRAIN_FLOPS_PER_FORWARD, GemFlopFormula, mfu, peak_flops
from gemcompile.runtime.training.host_profile import host_profile
from gemcompile.runtime.training.kernel_time import KernelProfile, kernel_profile
from gemcompile.runtime.training.memory_snapshot import run_snapshot, snapshot_lines
from gemcompile.runtime.training.metrics import MetricWindow
from gemcompile.runtime.training.optimizers import build_optimizers
from gemcompile.runtime.training.results import environment as results_environment
from gemcompile.runtime.training.step_timing import Timings, graph_count, sync, timed_steps

__all__ = ["E2EBenchConfig", "available_methods", "compile_method", "measure", "memory_section", "memory_variant",
           "methods_help", "run_e2e_bench", "split_method", "start_method", "step_begin", "unknown_methods"]

PASS_GROUPS_OFF_BY_DEFAULT = ("mxfp8", "token_column_sums")
"""GemConfig sections that are off by default and can run in one process (the parallel plan needs torchrun)."""


VARIANTS = {"gem-unpad-no-pad-reductions": {"unpad": {"pad_reductions": False}},
            "gem-unpad-pad-reductions": {"unpad": {"pad_reductions": True}},
            # every Linear-like GEMM the name patterns allow, however narrow (the MXFP8 quality study's
            # setting; the default minimum sizes leave GEM-ref small's layers, at most 1024 wide, in bf16)
            "gem+mxfp8-all": {"mxfp8": {"enabled": True, "min_m": 1, "min_k": 1, "min_n": 1}},
            # the partitioner under an activation memory budget (GemConfig.memory): peak memory vs step time
            "gem-memory-budget-0.5": {"memory": {"budget": 0.5}},
            "gem-memory-budget-0.2": {"memory": {"budget": 0.2}},
            # the input of each qualifying Linear held for its weight gradient in FP8 (MemoryConfig.fp8_saved)
            "gem+fp8-saved": {"memory": {"fp8_saved": True}},
            # unpad's packed lengths rounded up to 16 capacities of B * N: with @reduce-overhead, CUDA-graph
            # trees record a graph per capacity instead of one per batch (UnpadConfig.token_buckets)
            "gem-token-buckets": {"unpad": {"token_buckets": 16}}}
"""Named GemConfig variants beyond one pass group on or off (A/B of a pass's option). Any activation memory
budget, with or without FP8 saved activations, also has a name without an entry here (memory_variant)."""


_MEMORY_VARIANT = re.compile(r"gem-memory-budget-(?P<budget>[0-9][0-9.eE-]*)(?P<fp8>\+fp8-saved)?")


def memory_variant(budget: float | None, fp8_saved: bool = False) -> str:
    """The method name of gem_compile with GemConfig.memory set: ``gem-memory-budget-<budget>`` (the
    partitioner under that activation memory budget, a fraction in (0, 1]), ``gem+fp8-saved`` (FP8 saved
    activations, no budget), ``gem-memory-budget-<budget>+fp8-saved`` (both); ``gem`` for neither."""
    if budget is None:
        return "gem+fp8-saved" if fp8_saved else "gem"
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < budget <= 1.0:
        raise ValueError(f"activation memory budget {budget!r}: need a fraction in (0, 1]")
    name = f"gem-memory-budget-{float(budget):g}" + ("+fp8-saved" if fp8_saved else "")
    assert memory_section(name) is not None, name  # the name reads back as the same setting
    return name


def memory_section(method: str) -> dict[str, Any] | None:
    """GemConfig.memory of a memory_variant name: ``gem+fp8-saved`` or
    ``gem-memory-budget-<fraction>[+fp8-saved]``; None for any other name or a budget outside (0, 1]."""
    if method == "gem+fp8-saved":
        return {"fp8_saved": True}
    match = _MEMORY_VARIANT.fullmatch(method)
    if match is None:
        return None
    try:
        budget = float(match["budget"])
    except ValueError:
        return None
    if not 0.0 < budget <= 1.0:  # also refuses NaN
        return None
    return {"budget": budget, **({"fp8_saved": True} if match["fp8"] else {})}


COMPILE_SUFFIXES: dict[str, dict[str, Any]] = {
    "reduce-overhead": {"mode": "reduce-overhead"},
    "cpp-wrapper": {"options": {"cpp_wrapper": True}},
    # reduce-overhead plus Inductor's coordinate-descent tuning of its own Triton kernels' block sizes
    # (what mode="max-autotune" adds besides GEMM templates): the glue's reductions and pointwise kernels
    "reduce-overhead-cdt": {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}},
}
"""torch.compile settings a compiled method can take as a suffix, ``<method>@<suffix>`` (inductor@reduce-overhead,
gem@cpp-wrapper), for the peer too. Both attack the host time of a host-bound step: reduce-overhead
replays CUDA graphs (a graph that syncs with the host, as unpad's token count does, is not captured;
Inductor says so and runs it without CUDA graphs); cpp-wrapper has Inductor emit its kernel-launching
wrapper in C++ instead of Python (GEM-ref small at B 256 launches ~3900 kernels a step, H200 profile)."""


TABLE_TRAINING = {"eager": "dense", "inductor": "dense", "inductor-sparse-grad": "torch-sparse",
                  "gem-dense-tables": "dense"}
"""How a method trains its embedding tables: "dense" (a (rows x dim) gradient, torch's Adagrad), "torch-sparse"
(sparse=True: torch's sparse COO gradient, torch's Adagrad) or "sparse-rows" (gemcompile's row gradients and
SparseAdagrad, runtime/tables/sparse_adagrad.py); every gem method not listed here: "sparse-rows"."""


def table_training(method: str) -> str:
    """The method's way of training its embedding tables (TABLE_TRAINING)."""
    return TABLE_TRAINING.get(split_method(method)[0], "sparse-rows")


def split_method(method: str) -> tuple[str, str | None]:
    """``"gem@reduce-overhead"`` -> ``("gem", "reduce-overhead")``; a plain name -> ``(name, None)``."""
    base, sep, mode = method.partition("@")
    return (base, mode) if sep else (base, None)


def available_methods() -> list[str]:
    """Every method name the bench understands, given the passes GemConfig has (each compiled one also
    with an ``@<suffix>`` from COMPILE_SUFFIXES)."""
    config = GemConfig()
    methods = ["eager", "inductor", "inductor-sparse-grad", "gem", "gem-dense-tables"]
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        if not dataclasses.is_dataclass(section) or not hasattr(section, "enabled"):
            continue
        if section.enabled:
            methods.append(f"gem-no-{f.name}")
        elif f.name in PASS_GROUPS_OFF_BY_DEFAULT:
            methods.append(f"gem+{f.name}")
    methods += list(VARIANTS)
    return methods


@dataclass(frozen=True)
class E2EBenchConfig:
    """One e2e benchmark run."""

    size: str = "small"
    """GEM-ref preset (tiny, small, medium, large); medium is the one that fills an H200."""

    batch_size: int | None = None
    """Samples per step; None = the size's training default (runtime/training/config.py)."""

    fill: float = 0.5
    """Mean sequence length / padded length of the synthetic data."""

    steps: int = 50
    """Measured steps (batches of different lengths)."""

    warmup: int = 3
    """Steps before the measured ones (compilation happens here); at least 2 batch shapes."""

    methods: tuple[str, ...] = ("eager", "inductor", "gem")
    """Methods to run, in order; see available_methods()."""

    device: str = "cuda"
    """cuda, or cpu for a smoke run."""

    dtype: str = "bfloat16"
    """bfloat16 autocast (the GPU default) or float32."""

    ne_window: int = 20
    """Steps of the final NE window (NE compared against eager's)."""

    layers: bool = False
    """Also measure the local MFU of each GemLayer alone."""

    layer_reps: int = 20
    """Timed repetitions per layer (median)."""

    kernel_steps: int = 3
    """Train steps after the measured ones run under torch.profiler (CUDA only): their summed kernel
    time per step is the GPU's own share of a step (kernel_ms_per_step, host_share, mfu_at_kernel_time).
    0 = skip."""

    kernel_top: int = 40
    """Kernels with the most device time listed in each method's kernel_profile.top."""

    host_profile_steps: int = 0
    """Train steps after the kernel_steps run under Python's cProfile: the functions with the most host time
    per step go into the method's ``host_profile`` (runtime/training/host_profile.py). 0 = skip."""

    memory_snapshot: bool = False
    """CUDA only: one more train step after the measured ones (and the kernel_steps), outside their timing,
    under torch's CUDA memory history; its summary (runtime/training/memory_snapshot.py: the step's peak and
    the live blocks there grouped by allocating frame) is the method's ``memory_snapshot``. None on the CPU
    (no step run)."""

    seed: int = 0
    """Model initialization and data seed, the same for every method."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes copied into the results."""

    def __post_init__(self) -> None:
        for wrong, problem in (
            (self.warmup < 2, f"warmup = {self.warmup}: need >= 2 (two batch shapes settle dynamic shapes)"),
            (self.steps < 1, f"steps = {self.steps}: need >= 1"),
            # 0 ran the size's default and the results said 0 (train refuses it too)
            (self.batch_size is not None and self.batch_size < 1,
             f"batch_size = {self.batch_size}: need >= 1 (or None: the size's)"),
            (self.kernel_steps < 0 or self.host_profile_steps < 0, f"kernel_steps = {self.kernel_steps}, "
             f"host_profile_steps = {self.host_profile_steps}: need >= 0"),
            (not 0.0 < self.fill <= 1.0, f"fill = {self.fill}: need a float in (0, 1]"),
            (not 0 <= self.seed < 2**63, f"seed = {self.seed}: need an int in [0, 2**63)"),  # torch's int64
            (not self.methods, "methods is empty: name at least one (e.g. --methods eager)"),
            (self.dtype not in ("bfloat16", "float32"), f"dtype = {self.dtype!r}: need bfloat16 or float32")):
            if wrong:
                raise ValueError(f"E2EBenchConfig.{problem}")
        unknown = unknown_methods(self.methods)
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {methods_help()}")


def unknown_methods(methods) -> list[str]:
    """The names in methods the bench does not understand (see available_methods and COMPILE_SUFFIXES)."""
    known = available_methods()

    def ok(method: str) -> bool:
        base, mode = split_method(method)
        return ((base in known or memory_section(base) is not None)
                and (mode is None or (mode in COMPILE_SUFFIXES and base != "eager")))

    return [m for m in methods if not ok(m)]


def methods_help() -> str:
    return (f"{', '.join(available_methods())}, gem-memory-budget-<fraction in (0, 1]>[+fp8-saved]; each but "
            f"eager optionally with @{' / @'.join(COMPILE_SUFFIXES)}")


def _gem_config(method: str) -> GemConfig:
    if method in ("gem", "gem-dense-tables"):
        return GemConfig()
    if method in VARIANTS:
        return GemConfig(**VARIANTS[method])
    if (memory := memory_section(method)) is not None:
        return GemConfig(memory=memory)
    if method.startswith("gem-no-"):
        return GemConfig(**{method[len("gem-no-"):]: {"enabled": False}})
    if method.startswith("gem+"):
        return GemConfig(**{method[len("gem+"):]: {"enabled": True}})
    raise ValueError(method)


def compile_method(module: torch.nn.Module, method: str):
    """`module` compiled the method's way (eager: unchanged), with its @suffix's torch.compile settings."""
    method, suffix = split_method(method)
    kwargs = dict(COMPILE_SUFFIXES[suffix]) if suffix else {}
    if method == "eager":
        return module
    if method in ("inductor", "inductor-sparse-grad"):
        return torch.compile(module, **kwargs)
    from gemcompile import gem_compile

    return gem_compile(module, config=_gem_config(method), **kwargs)


def uses_cuda_graphs(method: str) -> bool:
    """Whether the method's @suffix has Inductor replay CUDA graphs (CUDA-graph trees)."""
    suffix = split_method(method)[1]
    settings = COMPILE_SUFFIXES.get(suffix, {}) if suffix else {}
    options = settings.get("options", {})
    return settings.get("mode") == "reduce-overhead" or bool(options.get("triton.cudagraphs"))


def step_begin(method: str) -> None:
    """Marks a new training step for CUDA-graph trees (a no-op for other methods): the previous step's
    outputs may then be overwritten by the next replay."""
    if uses_cuda_graphs(method):
        torch.compiler.cudagraph_mark_step_begin()


def _layer_inputs(model, batch) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) each GemLayer receives in one eager forward, detached (leaf copies)."""
    captured: list[tuple[tuple, dict]] = []

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.is_floating_point())
        if isinstance(x, (list, tuple)):
            return type(x)(leaf(v) for v in x)
        return x

    def hook(_mod, args, kwargs):
        captured.append((leaf(args), leaf(kwargs)))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.layers]
    try:
        with torch.no_grad():
            model(**batch.features())
    finally:
        for h in handles:
            h.remove()
    return captured


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _time_layer(fn, args, kwargs, reps: int, device: torch.device, autocast, method: str = "eager") -> float:
    """Median ms of one forward + backward of fn(*args, **kwargs)."""
    leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]

    def step():
        step_begin(method)
        with autocast():
            out = fn(*args, **kwargs)
        outs = [t for t in _tensors(out) if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        for t in leaves:
            t.grad = None

    for _ in range(3):
        step()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _layer_useful_flops(formula, prefix: str, seq_lengths, batch_size: int) -> int:
    return TRAIN_FLOPS_PER_FORWARD * sum(formula.breakdown(seq_lengths, batch_size, prefix=prefix).values())


def run_method(cfg: E2EBenchConfig, method: str, log=print) -> dict[str, Any]:
    """Train a fresh GEM-ref under one method and measure it (see the module docstring)."""
    run = _MethodRun.start(cfg, method)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings = timed_steps(run)
    # the GPU's own time per step, on batches after the measured ones (host gaps excluded)
    extra = range(cfg.warmup + cfg.steps, cfg.warmup + cfg.steps + cfg.kernel_steps)
    profiled = (kernel_profile(run.train_step, [run.data.batch(i).to(run.device) for i in extra], len(extra),
                               top=cfg.kernel_top) if run.device.type == "cuda" else None)
    result = _method_result(run, timings, profiled)
    first = cfg.warmup + cfg.steps + cfg.kernel_steps
    if cfg.host_profile_steps:
        batches = [run.data.batch(first + i).to(run.device) for i in range(cfg.host_profile_steps)]
        result["host_profile"] = host_profile(run.train_step, batches, cfg.host_profile_steps, run.device)
        first += cfg.host_profile_steps
    if cfg.memory_snapshot:
        result["memory_snapshot"] = run_snapshot(run, first)
    _log_method(log, result, profiled)
    for line in snapshot_lines(result.get("memory_snapshot")):
        log(f"    {line}")
    if cfg.layers:
        result["layers"] = _local_layers(run, log)
    del run
    gc.collect()
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.empty_cache()
    return result


def start_method(cfg: E2EBenchConfig, method: str, dynamic_batch: bool = False) -> _MethodRun:
    """A fresh GEM-ref compiled the method's way, not yet run (it compiles on its first step). With
    ``dynamic_batch`` the batch dim of every input is marked dynamic at the first call (Dynamo's
    maybe_mark_dynamic: no error where the program specializes it), so ``measure(run.at_batch(...))``
    runs other batch sizes without a compile each."""
    run = _MethodRun.start(cfg, method)
    if dynamic_batch and run.runner is not run.model:
        run.runner = _batch_dynamic(run.runner)
    return run


def _batch_dynamic(runner):
    def call(**features):
        for value in features.values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return runner(**features)

    return call


def measure(run: _MethodRun) -> dict[str, Any]:
    """Train ``run`` for its cfg's warm-up and measured steps and return its results row (run_method's,
    without the kernel profile); the CUDA peak is reset first."""
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = _method_result(run, timed_steps(run), None)
    if run.cfg.memory_snapshot:
        result["memory_snapshot"] = run_snapshot(run, run.cfg.warmup + run.cfg.steps)
    return result


def _data_and_window(cfg: E2EBenchConfig, batch_size: int) -> tuple[SyntheticData, MetricWindow]:
    """The method's batches (the same seed for every method) and its NE window over the measured steps."""
    model_cfg = gem_ref_config(cfg.size)
    return (SyntheticData(model_cfg.data_config(batch_size, fill=cfg.fill, seed=cfg.seed)),
            MetricWindow(model_cfg.n_tasks, window=cfg.ne_window))


@dataclass
class _MethodRun:
    """A fresh GEM-ref (the same seed and batches for every method) compiled the method's way."""

    cfg: E2EBenchConfig
    method: str
    device: torch.device
    batch_size: int
    data: SyntheticData
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    formula: GemFlopFormula
    window: MetricWindow
    """NE over the last ne_window measured steps."""
    runner: Any = None

    @classmethod
    def start(cls, cfg: E2EBenchConfig, method: str) -> _MethodRun:
        device = torch.device(cfg.device)
        batch_size = cfg.batch_size or DEFAULT_BATCH_SIZE[cfg.size]
        model_cfg = gem_ref_config(cfg.size)
        data, window = _data_and_window(cfg, batch_size)
        torch.manual_seed(cfg.seed)
        model = GemRef(model_cfg).to(device)
        tables = table_training(method)
        if tables == "torch-sparse":
            for m in model.modules():
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                    m.sparse = True
        # gem methods train their dense weights with gemcompile's TritonAdam; the peers with torch's fused Adam
        optimizers = build_optimizers(model, 1e-3, 0.01, sparse_embeddings=tables == "sparse-rows",
                                      triton_adam=split_method(method)[0].startswith("gem"))
        formula = GemFlopFormula.from_model(model)
        run = cls(cfg, method, device, batch_size, data, model, optimizers, formula, window)
        run.runner = compile_method(model, method)
        return run

    def at_batch(self, cfg: E2EBenchConfig) -> _MethodRun:
        """The same model, optimizers and compiled runner fed ``cfg``'s batch size (fresh batches and NE
        window): a program compiled with a dynamic batch runs it without compiling again."""
        data, window = _data_and_window(cfg, cfg.batch_size)
        return dataclasses.replace(self, cfg=cfg, batch_size=cfg.batch_size, data=data, window=window)

    def autocast(self):
        if self.cfg.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def train_step(self, batch) -> tuple[torch.Tensor, float]:
        step_begin(self.method)
        with self.autocast():
            logits = self.runner(**batch.features())
        loss = masked_bce_loss(logits.float(), batch.labels, batch.label_mask)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        # gradients dropped once used: not beside the next forward's activations (medium: 3.9 GiB), and the
        # host does it while the GPU runs the optimizers, not before the next step's first kernel
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return logits, loss.item()


def _method_result(run: _MethodRun, timings: Timings, profiled: KernelProfile | None) -> dict[str, Any]:
    """The method's row of the results JSON (see the module docstring)."""
    cfg, device, step_ms, losses = run.cfg, run.device, timings.step_ms, timings.losses
    total_s, median_ms = sum(step_ms) / 1e3, statistics.median(step_ms)
    useful_per_s = sum(timings.useful) / total_s
    kernel_ms = profiled.ms_per_step if profiled is not None else None
    useful_per_step = sum(timings.useful) / len(timings.useful)
    graphs_after_warmup = timings.graphs_after_warmup or 0
    return {
        "method": run.method, "samples_per_s": run.batch_size * len(step_ms) / total_s,
        "step_ms_median": median_ms,
        "step_ms_mean": 1e3 * total_s / len(step_ms), "step_ms": [round(t, 3) for t in step_ms],
        "useful_tflops": useful_per_s / 1e12,
        "mfu": mfu(useful_per_s, device),
        "kernel_ms_per_step": kernel_ms,
        "host_share": (1.0 - kernel_ms / median_ms) if kernel_ms else None,
        "mfu_at_kernel_time": mfu(useful_per_step / (kernel_ms / 1e3), device) if kernel_ms else None,
        # where the GPU time goes: the largest kernels, kernels per step, GEMM vs Triton vs copies
        "kernel_profile": profiled.as_json() if profiled is not None else None,
        # fused (one kernel per update) or foreach optimizers: their launches are part of the host time
        "optimizers": [f"{type(o).__name__}(fused={bool(o.defaults.get('fused'))})" for o in run.optimizers],
        "tables": table_training(run.method),
        "compile_s": max(0.0, timings.warmup_s - cfg.warmup * median_ms / 1e3),
        "kernel_tuning": timings.kernel_tuning,  # our Triton kernels' autotuning: part of compile_s
        "compile_phases": timings.compile_phases,  # torch's compile phases and gemcompile's passes, seconds
        "graphs_compiled": graphs_after_warmup - timings.graphs_before,
        "recompiles_after_warmup": graph_count() - graphs_after_warmup,
        "triton_compiles_after_warmup": [list(c) for c in timings.triton_compiles],  # (measured step, kernel)
        # (measured step, CUDA graphs captured in it): CUDA-graph trees recording inside the measured steps
        "cuda_graph_captures_after_warmup": [list(c) for c in timings.graph_captures],
        # over the warm-up (compilation included) and the measured steps: what must fit
        "peak_memory_gib": (max(timings.peak_warmup_bytes or 0, timings.peak_steady_bytes) / 2**30
                            if timings.peak_steady_bytes is not None else None),
        # over the measured steps alone: what a compiled step holds (the compile's transients left out)
        "peak_memory_steady_gib": (timings.peak_steady_bytes / 2**30
                                   if timings.peak_steady_bytes is not None else None),
        # runnable processes on the host (1-minute average) after the measured steps, against its cores: a
        # host-bound step's time is only comparable between runs on an equally quiet host
        "host_load": {"load_avg_1min": _load_average(), "cpus": os.cpu_count()},
        "ne": list(run.window.compute().ne),  # per task
        # NE >= 1 (4-70 after 20 steps of GEM-ref medium from a cold start) does not beat the base rate and
        # says nothing about quality: the console prints none and the gap to eager is not computed
        "ne_meaningful": ne_meaningful(list(run.window.compute().ne)),
        "final_loss": losses[-1],
        "losses": losses,
        "diverged": not all(math.isfinite(v) for v in losses),
    }


def ne_meaningful(ne: list[float]) -> bool:
    """Whether the NEs of a run say something about its quality: every task's NE finite and below 1 (the
    model beats predicting the base rate)."""
    return bool(ne) and all(math.isfinite(v) and v < 1.0 for v in ne)


def _ne_text(result: dict[str, Any]) -> str:
    if result.get("ne_meaningful", True):
        return f"NE {', '.join(f'{v:.5f}' for v in result['ne'])}"
    return "NE n/a (>= 1: not past the base rate yet; more --steps)"


def _log_method(log, result: dict[str, Any], profiled: KernelProfile | None) -> None:
    kernel_ms, median_ms = result["kernel_ms_per_step"], result["step_ms_median"]
    log(f"  {result['method']:22s} {result['samples_per_s']:10.0f} samples/s  "
        f"{result['useful_tflops']:7.2f} TF/s  "
        f"MFU {_pct(result['mfu'])}  compile {result['compile_s']:6.1f} s  recompiles "
        f"{result['recompiles_after_warmup']}  {_ne_text(result)}"
        + (f"  kernels {kernel_ms:.1f} of {median_ms:.1f} ms/step" if kernel_ms else "")
        + (f"  (step ms mean {result['step_ms_mean']:.1f}, slowest {max(result['step_ms']):.1f})"
           if result.get("step_ms") else ""))
    if profiled is not None:
        log("    GPU ms/step by kernel class: " + ", ".join(f"{k} {v:.1f}" for k, v in profiled.by_class.items())
            + f"; {profiled.kernels_per_step:.0f} kernels/step"
            + (f"; GPU idle {profiled.idle['idle_ms_per_step']:.1f} ms/step" if profiled.idle else ""))
    phases = result.get("compile_phases") or {}
    passes, tuning = phases.get("gemcompile_passes_s") or {}, result.get("kernel_tuning") or {}
    if passes or tuning.get("seconds"):
        log(f"    compile: gemcompile passes {sum(passes.values()):.1f} s ("
            + ", ".join(f"{k} {v:.1f}" for k, v in list(passes.items())[:4])
            + f"), kernel tuning {tuning.get('seconds', 0.0):.1f} s")
    for row in (result.get("host_profile") or {}).get("by_own_time", [])[:10]:
        log(f"    host {row['own_ms_per_step']:7.2f} ms/step own, {row['calls_per_step']:7.0f} calls: "
            f"{row['function']}")
    if result.get("triton_compiles_after_warmup"):
        log("    Triton JIT compiles inside measured steps (step, kernel): "
            f"{result['triton_compiles_after_warmup']}")
    if result.get("cuda_graph_captures_after_warmup"):
        log("    CUDA graphs captured inside measured steps (step, captures): "
            f"{result['cuda_graph_captures_after_warmup']}")


def _local_layers(run: _MethodRun, log) -> list[dict]:
    cfg, device = run.cfg, run.device
    batch = run.data.batch(cfg.warmup + cfg.steps).to(device)
    with run.autocast():
        inputs = _layer_inputs(run.model, batch)
    rows = []
    for i, (layer, (args, kwargs)) in enumerate(zip(run.model.layers, inputs)):
        torch._dynamo.reset()
        ms = _time_layer(compile_method(layer, run.method), args, kwargs, cfg.layer_reps, device, run.autocast,
                         run.method)
        flops = _layer_useful_flops(run.formula, f"layers.{i}.", batch.seq_lengths, run.batch_size)
        rows.append({"layer": i, "ms": ms, "useful_tflops": flops / ms / 1e9,
                     "local_mfu": mfu(flops / ms * 1e3, device)})
        log(f"    layer {i}: {ms:8.3f} ms  {flops / ms / 1e9:7.2f} TF/s  local MFU {_pct(rows[-1]['local_mfu'])}")
    return rows


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"


def run_e2e_bench(cfg: E2EBenchConfig, log=print, on_progress=None) -> dict[str, Any]:
    """Every method of cfg, one after the other in this process; ratios against inductor and eager.

    on_progress, if given, receives the payload so far after each method: a run cut by a time limit
    keeps the methods that finished."""
    results = []
    for method in cfg.methods:
        torch._dynamo.reset()
        log(f"-- {method}")
        try:
            results.append(run_method(cfg, method, log))
        except Exception as e:  # a method that fails (OOM, a compile error) is recorded; the others still run
            # the traceback goes to the log in full and into the JSON (its tail): a compile error is
            # only diagnosable from where it was raised
            tb = traceback.format_exc()
            results.append({"method": method, "error": f"{type(e).__name__}: {str(e)[:400]}",
                            "traceback_tail": tb[-4000:]})
            log(f"  {method} failed: {results[-1]['error'][:200]}\n{tb}")
        if on_progress is not None:
            on_progress(_payload(cfg, [dict(r) for r in results]))
    return _payload(cfg, results)


def _payload(cfg: E2EBenchConfig, results: list[dict]) -> dict[str, Any]:
    """The results JSON: per-method rows with ratios against inductor and eager where they ran."""
    device = torch.device(cfg.device)
    by_name = {r["method"]: r for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            continue
        for peer in ("inductor", "inductor@reduce-overhead", "eager"):
            if peer in by_name:
                r[f"speedup_vs_{peer}"] = r["samples_per_s"] / by_name[peer]["samples_per_s"]
                # by the median step: what a long run's steady state pays, without one-time costs inside
                # the measured steps (a CUDA-graph recording of a size pair the warm-up did not draw)
                theirs, ours = by_name[peer].get("step_ms_median"), r.get("step_ms_median")
                if theirs and ours:
                    r[f"median_step_speedup_vs_{peer}"] = theirs / ours
        if "inductor" in by_name and by_name["inductor"]["compile_s"] > 0:
            r["compile_time_vs_inductor"] = r["compile_s"] / by_name["inductor"]["compile_s"]
        if "eager" in by_name:  # the largest relative gap over the tasks, where both NEs mean something
            eager = by_name["eager"]
            both = r.get("ne_meaningful", True) and eager.get("ne_meaningful", True)
            gaps = [abs(a - b) / abs(b) for a, b in zip(r["ne"], eager["ne"]) if b] if both else []
            r["ne_rel_diff_vs_eager"] = max(gaps) if gaps else None
    batch_size = cfg.batch_size or DEFAULT_BATCH_SIZE[cfg.size]  # the one _MethodRun.start trains with
    return {
        "benchmark": "e2e",
        "environment": results_environment(),  # the one results writer's block (GPU, versions, commit, command)
        "config": {**dataclasses.asdict(cfg), "batch_size": batch_size},
        "peak_bf16_dense_tflops": (peak_flops(device) or 0) / 1e12 or None,
        "conventions": {
            "useful_flops": "runtime/training/flops.py section-8 formula: valid tokens only, training = 3x forward",
            "compile_s": "warm-up wall time minus warm-up steps x the median measured step",
            "recompiles_after_warmup": "Dynamo graphs compiled during the measured steps",
            "speedup_vs_<peer>": "samples/s over the peer's (the mean step); median_step_speedup_vs_<peer>: "
                                 "the peer's median step over this one's",
            "ne_rel_diff_vs_eager": "max over tasks of |NE - NE_eager| / NE_eager over the last ne_window "
                                    "steps, same batches; None unless both runs' NEs are meaningful",
            "ne_meaningful": "every task's NE finite and < 1 (beats the base rate); NE >= 1 after a short run "
                             "from a cold start says nothing about quality",
        },
        "results": results,
    }
