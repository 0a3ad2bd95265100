"""`gemcompile bench e2e` (runtime/training/e2e_bench.py) on the CPU: the method list, config errors, and
one eager run whose numbers are checked against what they must be; and the report renderer on its JSON."""

import json
import math

import pytest
import torch

from gemcompile.runtime.training import e2e_bench
from gemcompile.runtime.training.e2e_bench import E2EBenchConfig, available_methods, run_e2e_bench, unknown_methods
from tests.benchmark_scripts import load_benchmark


def test_methods_follow_the_config_sections():
    methods = available_methods()
    assert methods[:5] == ["eager", "inductor", "inductor-sparse-grad", "gem", "gem-dense-tables"]
    assert "gem-no-jagged_attention" in methods and "gem-no-gdpa" in methods
    assert "gem+mxfp8" in methods  # off by default: offered switched on
    assert not any("parallel" in m for m in methods)  # needs torchrun


def test_how_each_method_trains_its_tables():
    """The peers train tables the PyTorch ways (dense, or torch's sparse gradients); gem methods sparsely."""
    assert [e2e_bench.table_training(m) for m in ("eager", "inductor@reduce-overhead", "inductor-sparse-grad",
                                                  "gem", "gem-no-unpad", "gem-dense-tables@reduce-overhead")] == \
        ["dense", "dense", "torch-sparse", "sparse-rows", "sparse-rows", "dense"]


def test_variant_configs():
    every = e2e_bench._gem_config("gem+mxfp8-all").mxfp8
    assert every.enabled and (every.min_m, every.min_k, every.min_n) == (1, 1, 1)
    default = e2e_bench._gem_config("gem+mxfp8").mxfp8
    assert default.enabled and default.min_k > 1  # the default minimum sizes stay
    assert e2e_bench._gem_config("gem-unpad-pad-reductions").unpad.pad_reductions is True


def test_compile_mode_suffix():
    assert unknown_methods(["inductor@reduce-overhead", "gem-no-unpad@reduce-overhead", "gem"]) == []
    assert unknown_methods(["eager@reduce-overhead", "gem@max-speed", "fast@reduce-overhead", "gem@"]) == [
        "eager@reduce-overhead", "gem@max-speed", "fast@reduce-overhead", "gem@"]


@pytest.mark.parametrize("method, mode", [("inductor", None), ("inductor@reduce-overhead", "reduce-overhead"),
                                          ("gem-no-unpad@reduce-overhead", "reduce-overhead"), ("gem", None)])
def test_the_mode_reaches_torch_compile(monkeypatch, method, mode):
    import gemcompile

    seen = {}

    def fake_compile(module, **kwargs):
        seen.update(kwargs)
        return module

    monkeypatch.setattr(e2e_bench.torch, "compile", fake_compile)
    monkeypatch.setattr(gemcompile, "gem_compile", fake_compile)
    e2e_bench.compile_method(object(), method)
    assert seen.get("mode") == mode
    if method.startswith("gem-no-unpad"):
        assert seen["config"].unpad.enabled is False


@pytest.mark.parametrize("kwargs,match", [
    ({"warmup": 1}, "warmup"), ({"steps": 0}, "steps"), ({"fill": 0.0}, "fill"),
    ({"methods": ("eager", "fast")}, "unknown method"), ({"dtype": "float16"}, "dtype"),
    ({"methods": ("eager@reduce-overhead",)}, "unknown method"), ({"kernel_steps": -1}, "kernel_steps"),
    ({"host_profile_steps": -1}, "host_profile_steps"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        E2EBenchConfig(**kwargs)


def test_eager_run_reports_consistent_numbers(tmp_path):
    cfg = E2EBenchConfig(size="tiny", batch_size=64, steps=3, warmup=2, methods=("eager",), device="cpu",
                         dtype="float32", ne_window=3, layers=True, layer_reps=2, host_profile_steps=1)
    payload = run_e2e_bench(cfg, log=lambda *a: None)
    (r,) = payload["results"]
    assert "error" not in r, r
    assert len(r["losses"]) == 5 and not r["diverged"]
    # samples/s is batch x measured steps / their total time: consistent with the mean step time
    assert r["samples_per_s"] == pytest.approx(64 / (r["step_ms_mean"] / 1e3), rel=1e-9)
    assert r["useful_tflops"] > 0 and r["mfu"] is None  # no GPU peak on the CPU
    assert r["kernel_ms_per_step"] is None and r["host_share"] is None and r["mfu_at_kernel_time"] is None
    assert r["recompiles_after_warmup"] == 0 and r["graphs_compiled"] == 0  # eager compiles nothing
    assert len(r["ne"]) == 2 and all(math.isfinite(v) and v > 0 for v in r["ne"])
    # the results writer's environment block travels with the payload (benchmarks/render_report.py needs it)
    env = payload["environment"]
    assert env["writer"].startswith("gemcompile.runtime.training.results") and env["gpu"] is None
    assert env["torch"] == torch.__version__ and env["machine_shared"] in ("yes", "no", "unknown")
    assert [row["layer"] for row in r["layers"]] == [0, 1] and all(row["ms"] > 0 for row in r["layers"])
    assert r["host_load"]["cpus"] >= 1 and r["host_load"]["load_avg_1min"] >= 0
    # no Triton kernel on the CPU: no JIT compile inside a step, no autotuning in the warm-up
    assert r["triton_compiles_after_warmup"] == [] and r["kernel_tuning"]["keys"] == 0
    assert r["cuda_graph_captures_after_warmup"] == []  # no CUDA graph on the CPU
    assert r["compile_phases"]["gemcompile_passes_s"] == {}  # eager runs no pass
    # one step under cProfile after the measured ones: the model's forward is among the busiest functions
    profile = r["host_profile"]
    assert profile["steps"] == 1 and profile["wall_ms_per_step"] > 0
    assert any("gem.py" in row["function"] for row in profile["by_cumulative_time"])

    # the renderer turns the JSON into a markdown row per method
    render = load_benchmark("render_report", "render_report")
    path = tmp_path / "e2e-tiny-20261130-000000.json"
    path.write_text(json.dumps(payload))
    markdown = "\n".join(render._e2e_table(path, json.loads(path.read_text())))
    assert "| eager |" in markdown and "samples/s" in markdown and "torch 2." in markdown


def test_ratios_against_the_peers_come_from_their_rows():
    """speedup_vs_inductor/eager, compile_time_vs_inductor and the NE gap, on rows with known values."""
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=1, warmup=2, methods=("eager", "inductor", "gem"),
                         device="cpu", dtype="float32")
    rows = [{"method": "eager", "samples_per_s": 100.0, "compile_s": 0.0, "ne": [1.0, 2.0]},
            {"method": "inductor", "samples_per_s": 200.0, "compile_s": 10.0, "ne": [1.2, 2.0]},
            {"method": "gem", "samples_per_s": 300.0, "compile_s": 15.0, "ne": [1.05, 1.8]},
            {"method": "gem-no-unpad", "error": "OutOfMemoryError: ..."}]
    by = {r["method"]: r for r in e2e_bench._payload(cfg, rows)["results"]}
    assert by["gem"]["speedup_vs_inductor"] == pytest.approx(1.5)
    assert by["gem"]["speedup_vs_eager"] == pytest.approx(3.0)
    assert by["gem"]["compile_time_vs_inductor"] == pytest.approx(1.5)
    assert by["gem"]["ne_rel_diff_vs_eager"] == pytest.approx(0.1)  # max(0.05 / 1.0, 0.2 / 2.0)
    assert by["inductor"]["ne_rel_diff_vs_eager"] == pytest.approx(0.2)
    assert "speedup_vs_inductor" not in by["gem-no-unpad"]  # a failed method gets no ratios


def test_ratios_by_the_median_step_and_against_the_cuda_graph_peer():
    """A one-time cost inside the measured steps moves the mean (samples/s), not the median: both ratios are
    written, against torch.compile's default mode and its CUDA-graph mode."""
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=1, warmup=2, device="cpu", dtype="float32",
                         methods=("inductor", "inductor@reduce-overhead", "gem@reduce-overhead"))
    rows = [{"method": m, "samples_per_s": rate, "step_ms_median": median, "compile_s": 1.0}
            for m, rate, median in [("inductor", 100.0, 80.0), ("inductor@reduce-overhead", 125.0, 64.0),
                                    ("gem@reduce-overhead", 150.0, 40.0)]]
    by = {r["method"]: r for r in e2e_bench._payload(cfg, rows)["results"]}
    gem = by["gem@reduce-overhead"]
    assert gem["speedup_vs_inductor"] == pytest.approx(1.5)
    assert gem["median_step_speedup_vs_inductor"] == pytest.approx(2.0)
    assert gem["speedup_vs_inductor@reduce-overhead"] == pytest.approx(1.2)
    assert gem["median_step_speedup_vs_inductor@reduce-overhead"] == pytest.approx(1.6)


def test_ne_past_the_base_rate_only_is_compared_and_printed():
    """NE >= 1 (a short run that has not beaten the base rate yet) is neither compared with eager's nor printed."""
    assert e2e_bench.ne_meaningful([0.9, 0.99]) and not e2e_bench.ne_meaningful([0.9, 1.0])
    assert not e2e_bench.ne_meaningful([float("nan"), 0.5]) and not e2e_bench.ne_meaningful([])
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=1, warmup=2, methods=("eager", "gem"), device="cpu",
                         dtype="float32")
    rows = [{"method": "eager", "samples_per_s": 100.0, "compile_s": 0.0, "ne": [45.0, 7.6], "ne_meaningful": False},
            {"method": "gem", "samples_per_s": 150.0, "compile_s": 1.0, "ne": [0.9, 0.95], "ne_meaningful": True}]
    by = {r["method"]: r for r in e2e_bench._payload(cfg, rows)["results"]}
    assert by["gem"]["ne_rel_diff_vs_eager"] is None
    printed = []
    result = {"method": "eager", "samples_per_s": 1.0, "useful_tflops": 1.0, "mfu": None, "compile_s": 0.0,
              "recompiles_after_warmup": 0, "kernel_ms_per_step": None, "step_ms_median": 1.0, **rows[0]}
    e2e_bench._log_method(printed.append, result, None)
    assert "NE n/a" in printed[0] and "45.0" not in printed[0]
    e2e_bench._log_method(printed.append, {**result, "ne": [0.9, 0.95], "ne_meaningful": True}, None)
    assert "NE 0.90000, 0.95000" in printed[1]


def test_cli_records_the_command_in_the_results_json(tmp_path):
    from gemcompile.cli import main

    argv = ["bench", "e2e", "--size", "tiny", "--batch-size", "8", "--steps", "1", "--warmup", "2",
            "--methods", "eager", "--device", "cpu", "--dtype", "float32", "--seed", "3",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("e2e-tiny-*.json")
    payload = json.loads(path.read_text())
    assert payload["command"] == "gemcompile " + " ".join(argv)
    assert payload["config"]["seed"] == 3
    assert payload["results"][0]["method"] == "eager"


def test_results_are_handed_over_after_each_method():
    # a run cut by a time limit must keep the methods that finished: one payload per method, growing
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=1, warmup=2, methods=("eager", "eager"),
                         device="cpu", dtype="float32", ne_window=1)
    seen = []
    final = run_e2e_bench(cfg, log=lambda *a: None, on_progress=lambda p: seen.append(p))
    assert [len(p["results"]) for p in seen] == [1, 2]
    assert [r["method"] for r in seen[-1]["results"]] == [r["method"] for r in final["results"]]
    assert seen[0]["results"][0]["samples_per_s"] == final["results"][0]["samples_per_s"]


def test_a_failed_method_keeps_its_traceback(monkeypatch):
    """A method that raises (a compile error on the GPU) is recorded with where it was raised, in the log and
    in the JSON, and the next method still runs."""
    real, calls = e2e_bench.run_method, []

    def fail_first(cfg, method, log):
        calls.append(method)
        if len(calls) == 1:
            raise RuntimeError("guard on a data-dependent size")
        return real(cfg, method, log)

    monkeypatch.setattr(e2e_bench, "run_method", fail_first)
    logged = []
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=1, warmup=2, methods=("eager", "eager"),
                         device="cpu", dtype="float32", ne_window=1)
    failed, ran = run_e2e_bench(cfg, log=logged.append)["results"]
    assert failed["error"] == "RuntimeError: guard on a data-dependent size"
    assert "Traceback" in failed["traceback_tail"] and "in fail_first" in failed["traceback_tail"]
    assert any("in fail_first" in str(line) for line in logged)
    assert "error" not in ran and ran["samples_per_s"] > 0


def test_cpp_wrapper_suffix_reaches_torch_compile_as_an_inductor_option(monkeypatch):
    # the suffix must reach Inductor as options={"cpp_wrapper": True}, for the peer and for gem_compile
    assert unknown_methods(["gem@cpp-wrapper", "inductor@cpp-wrapper"]) == []
    assert unknown_methods(["eager@cpp-wrapper", "gem@fast"]) == ["eager@cpp-wrapper", "gem@fast"]
    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: seen.append(kw) or module)
    e2e_bench.compile_method(torch.nn.Identity(), "inductor@cpp-wrapper")
    assert seen == [{"options": {"cpp_wrapper": True}}]


def test_the_memory_budget_variants_set_the_budget():
    assert e2e_bench._gem_config("gem-memory-budget-0.5").memory.budget == 0.5
    assert "gem-memory-budget-0.2" in e2e_bench.available_methods()


def test_a_memory_snapshot_on_the_cpu_is_none_and_runs_no_extra_step(monkeypatch):
    """memory_snapshot=True off CUDA: the result says None, and no step beyond warm-up + measured ran (in
    run_method and in measure)."""
    steps = []
    real = e2e_bench._MethodRun.train_step
    monkeypatch.setattr(e2e_bench._MethodRun, "train_step", lambda self, batch: steps.append(1) or real(self, batch))
    cfg = E2EBenchConfig(size="tiny", batch_size=8, steps=2, warmup=2, methods=("eager",), device="cpu",
                         dtype="float32", ne_window=2, memory_snapshot=True)
    (r,) = run_e2e_bench(cfg, log=lambda *a: None)["results"]
    assert "error" not in r, r
    assert r["memory_snapshot"] is None and len(steps) == 4 == len(r["losses"])
    steps.clear()
    r = e2e_bench.measure(e2e_bench.start_method(cfg, "eager"))
    assert r["memory_snapshot"] is None and len(steps) == 4
    assert E2EBenchConfig().memory_snapshot is False


_MEASURED = {"results": [{"method": "eager"}]}
"""What a stubbed run_e2e_bench returns: one method measured (a run where every method failed exits 1)."""


def test_cli_memory_snapshot_flag_reaches_the_config(monkeypatch):
    from gemcompile.cli import main

    seen = []
    monkeypatch.setattr(e2e_bench, "run_e2e_bench", lambda cfg, on_progress=None: seen.append(cfg) or _MEASURED)
    assert main(["bench", "e2e", "--methods", "eager", "--device", "cpu", "--memory-snapshot"]) == 0
    assert main(["bench", "e2e", "--methods", "eager", "--device", "cpu"]) == 0
    assert [cfg.memory_snapshot for cfg in seen] == [True, False]


def test_cli_kernel_steps_reach_the_config(monkeypatch):
    from gemcompile.cli import main

    seen = []
    monkeypatch.setattr(e2e_bench, "run_e2e_bench", lambda cfg, on_progress=None: seen.append(cfg) or _MEASURED)
    assert main(["bench", "e2e", "--methods", "eager", "--device", "cpu", "--kernel-steps", "0"]) == 0
    assert main(["bench", "e2e", "--methods", "eager", "--device", "cpu"]) == 0
    assert [cfg.kernel_steps for cfg in seen] == [0, 3]
