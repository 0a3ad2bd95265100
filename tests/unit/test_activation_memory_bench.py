"""benchmarks/activation_memory.py (issue 26) without compiling anything: the memory method names e2e_bench
understands, the largest-batch search on fake "fits" functions, and the whole script on the CPU with
e2e_bench.run_method replaced by a fake (the JSON after every method, the time budget, the CPU skip)."""

import functools
import json
from types import SimpleNamespace

import pytest
import torch

from gemcompile.config import ConfigError, MemoryConfig
from gemcompile.runtime.training import e2e_bench
from gemcompile.runtime.training.e2e_bench import E2EBenchConfig, memory_variant, unknown_methods
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("activation_memory", "activation_memory_bench", register=True)


# -- the method names --------------------------------------------------------------------------------------


def test_memory_variant_names_read_back_as_their_config():
    assert memory_variant(0.5) == "gem-memory-budget-0.5"
    assert memory_variant(0.25, fp8_saved=True) == "gem-memory-budget-0.25+fp8-saved"
    assert memory_variant(None, fp8_saved=True) == "gem+fp8-saved" and memory_variant(None) == "gem"
    assert memory_variant(1) == "gem-memory-budget-1"
    for name, memory in [("gem-memory-budget-0.3", MemoryConfig(budget=0.3)),
                         ("gem-memory-budget-0.1+fp8-saved", MemoryConfig(budget=0.1, fp8_saved=True)),
                         ("gem+fp8-saved", MemoryConfig(fp8_saved=True)),
                         ("gem-memory-budget-0.5", MemoryConfig(budget=0.5)),  # the names from before stay
                         ("gem-memory-budget-0.2", MemoryConfig(budget=0.2))]:
        assert e2e_bench._gem_config(name).memory == memory, name
        assert MemoryConfig(**e2e_bench.memory_section(name)) == memory, name  # mxfp8_quality's recipes
        assert unknown_methods([name, f"{name}@reduce-overhead"]) == []
        assert e2e_bench.table_training(name) == "sparse-rows"
    assert "gem+fp8-saved" in e2e_bench.available_methods()
    assert [e2e_bench.memory_section(m) for m in ("gem", "gem+mxfp8", "blockwise")] == [None] * 3


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_a_budget_outside_0_1_has_no_name(budget):
    with pytest.raises(ValueError, match="budget"):
        memory_variant(budget)


def test_malformed_memory_names_are_unknown():
    bad = ["gem-memory-budget-0", "gem-memory-budget-1.5", "gem-memory-budget-abc", "gem-memory-budget-",
           "gem-memory-budget-0.5+fp8", "gem-memory-budget-0.5+fp8-saved+fp8-saved",
           "eager-memory-budget-0.5"]
    assert unknown_methods(bad) == bad
    with pytest.raises(ValueError, match="unknown method"):
        E2EBenchConfig(methods=("gem-memory-budget-2",))
    with pytest.raises(ConfigError):
        MemoryConfig(budget=0.0)


def test_the_default_curve(bench):
    args = bench.parse_args(["--device", "cpu"])
    assert args.methods == ["gem", "gem-memory-budget-0.8", "gem-memory-budget-0.5", "gem-memory-budget-0.3",
                            "gem-memory-budget-0.1", "gem+fp8-saved", "gem-memory-budget-0.5+fp8-saved",
                            "inductor"]
    assert (args.size, args.batch_size, args.fill, args.steps, args.warmup) == ("medium", 256, 0.5, 8, 2)
    assert bench.parse_args(["--device", "cpu", "--no-fp8", "--budgets", "0.5"]).methods == \
        ["gem", "gem-memory-budget-0.5", "inductor"]
    assert [m for m in args.methods if bench.is_memory_setting(m)] == args.methods[1:-1]


@pytest.mark.parametrize("argv, match", [
    (["--budgets", "0.5,2"], "outside"), (["--budgets", "half"], "not a number"),
    (["--methods", "inductor"], "need gem"), (["--methods", "gem,fast"], "unknown method"),
    (["--parts", "curve,plot"], "--parts"), (["--warmup", "1"], "warmup"),
    (["--max-batch", "128"], "max-batch"), (["--largest-methods", "gem,nope"], "unknown method"),
    (["--fill", "1.5"], "fill"), (["--time-budget-s", "nan"], "time-budget-s"),
])
def test_bad_arguments_are_refused_with_a_message(bench, capsys, argv, match):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *argv])
    assert match in capsys.readouterr().err


# -- the search ----------------------------------------------------------------------------------------------


def _fits_below(limit, seen=None):
    def attempt(batch):
        if seen is not None:
            seen.append(batch)
        return "fits" if batch <= limit else "oom"
    return attempt


def test_doubling_then_bisecting(bench):
    seen = []
    found = bench.find_largest_batch(_fits_below(700, seen), 256, 8192, start_fits=True)
    assert seen == [512, 1024, 768, 640]  # 640..768 is within 0.25 x 640
    assert (found["largest_fit"], found["smallest_oom"], found["stopped"]) == (640, 768, "bracketed")
    seen.clear()
    found = bench.find_largest_batch(_fits_below(700, seen), 256, 8192, start_fits=True, resolution=0)
    assert seen == [512, 1024, 768, 640, 704] and (found["largest_fit"], found["smallest_oom"]) == (640, 704)
    assert [t["outcome"] for t in found["tries"]] == ["fits", "oom", "oom", "fits", "oom"]


def test_the_cap_and_an_unknown_start(bench):
    seen = []
    found = bench.find_largest_batch(_fits_below(10**6, seen), 256, 1000, start_fits=True)
    assert seen == [512, 1000] and found["largest_fit"] == 1000
    assert found["stopped"] == "reached --max-batch 1000"
    seen.clear()
    found = bench.find_largest_batch(_fits_below(100, seen), 256, 8192)  # the start itself does not fit
    assert seen == [256, 128, 64] and (found["largest_fit"], found["smallest_oom"]) == (64, 128)
    found = bench.find_largest_batch(_fits_below(10), 256, 8192)
    assert found["largest_fit"] is None and found["stopped"] == "nothing fits down to 64"


def test_an_error_or_the_clock_stops_the_search(bench):
    found = bench.find_largest_batch(lambda b: "fits" if b < 1024 else "error (boom)", 256, 8192,
                                     start_fits=True)
    assert found["largest_fit"] == 512 and found["smallest_oom"] is None
    assert found["stopped"] == "error (boom) at batch 1024"
    calls = []
    found = bench.find_largest_batch(_fits_below(10**6, calls), 256, 8192, start_fits=True,
                                     may_start=lambda: "time budget" if len(calls) >= 2 else None)
    assert calls == [512, 1024] and found["largest_fit"] == 1024 and found["stopped"] == "time budget"


def test_out_of_memory_is_recognized_through_the_chain(bench):
    assert bench.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            raise torch.cuda.OutOfMemoryError("Tried to allocate")
        except Exception as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as outer:
        assert bench.is_oom(outer)
    assert bench.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not bench.is_oom(ValueError("shape mismatch")) and not bench.is_oom(None)


def test_ratios_and_the_best_memory_setting(bench):
    def row(method, peak, ms, loss=0.7):
        return {"method": method, "outcome": "fits", "peak_memory_gib": peak, "step_ms_median": ms,
                "losses": [loss]}

    results = [row("gem", 50.0, 100.0), row("gem-memory-budget-0.5", 30.0, 104.0, 0.7007),
               row("gem-memory-budget-0.1", 20.0, 150.0), row("inductor", 70.0, 200.0),
               {"method": "gem+fp8-saved", "outcome": "oom", "error": "OutOfMemoryError: ..."}]
    rows = {r["method"]: r for r in bench.curve_rows(results)}
    assert rows["gem-memory-budget-0.5"]["peak_memory_ratio_vs_gem"] == pytest.approx(0.6)
    assert rows["gem-memory-budget-0.5"]["memory_saving_vs_gem"] == pytest.approx(0.4)
    assert rows["gem-memory-budget-0.5"]["step_time_ratio_vs_gem"] == pytest.approx(1.04)
    assert rows["gem-memory-budget-0.5"]["first_loss_rel_diff_vs_gem"] == pytest.approx(0.001)
    failed = rows["gem+fp8-saved"]
    assert failed["peak_memory_ratio_vs_gem"] is None and "OutOfMemory" in failed["note"]
    best, why = bench.pick_best(list(rows.values()), 1.10)
    assert best == "gem-memory-budget-0.5" and "1.1x" in why  # 0.1 is lower but slower; inductor: no setting
    assert bench.pick_best(list(rows.values()), 1.0)[0] == "gem-memory-budget-0.1"  # none within: lowest peak
    assert bench.pick_best([rows["gem"]], 1.1)[0] is None


def test_a_linear_estimate_from_the_peaks(bench):
    est = bench.linear_estimate([(256, 35.6), (512, 61.2)], 139.8)
    assert est["gib_per_sample"] == pytest.approx(0.1) and est["fixed_gib"] == pytest.approx(10.0)
    assert abs(est["batch_at_device_memory"] - 1298) <= 1
    assert bench.linear_estimate([(256, 35.6)], 139.8) is None  # one point
    assert bench.linear_estimate([(256, 1), (512, 2)], None) is None  # no device memory known


# -- the script, with a fake run_method ----------------------------------------------------------------------


class _FakeTraining:
    """run_method's stand-in: peak = 10 + 0.1 x batch (x 0.5 under a budget), OOM above `capacity` GiB; each
    call advances the fake clock by `seconds`."""

    def __init__(self, capacity=80.0, seconds=10.0):
        self.capacity, self.seconds, self.now, self.calls = capacity, seconds, 0.0, []

    def clock(self):
        return self.now

    def __call__(self, cfg, method, log=print):
        self.calls.append((method, cfg.batch_size))
        self.now += self.seconds
        share = 0.5 if "budget" in method else 1.0
        peak = 10.0 + 0.1 * cfg.batch_size * share
        if peak > self.capacity:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return {"method": method, "peak_memory_gib": peak, "step_ms_median": 105.0 if share < 1 else 100.0,
                "losses": [0.69], "mfu": 0.2, "samples_per_s": cfg.batch_size * 10.0, "compile_s": 1.0}


def test_the_cpu_run_writes_its_json_after_every_method(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    fake = _FakeTraining(seconds=100.0)
    monkeypatch.setattr(e2e_bench, "run_method", fake)
    written = []
    real = bench.rewrite_results
    monkeypatch.setattr(bench, "rewrite_results", lambda path, payload: written.append(
        [r["method"] for r in payload["curve"]["results"]]) or real(path, payload))
    payload = bench.main(["--size", "tiny", "--batch-size", "4", "--device", "cpu", "--budgets", "0.5,0.1",
                          "--time-budget-s", "250", "--out", str(tmp_path)], clock=fake.clock)
    # 100 s a method: the third starts at 200 s (< 250), the fourth would start at 300 s: skipped, recorded
    assert [c[0] for c in fake.calls] == ["gem", "gem-memory-budget-0.5", "gem-memory-budget-0.1"]
    outcomes = [r["outcome"] for r in payload["curve"]["results"]]
    assert outcomes == ["fits", "fits", "fits", "skipped", "skipped", "skipped"]
    assert "time budget" in payload["curve"]["rows"][3]["note"]
    methods = [r["method"] for r in payload["curve"]["results"]]
    assert written[:6] == [methods[:i] for i in range(1, 7)]  # one save per method, growing
    assert "--device cpu" in payload["largest_batch"]["skipped"]
    (path,) = tmp_path.glob("activation_memory-tiny-b4-*.json")
    saved = json.loads(path.read_text())
    assert saved["environment"]["writer"].startswith("gemcompile.runtime.training.results")
    assert saved["curve"]["rows"][1]["peak_memory_ratio_vs_gem"] == pytest.approx(10.2 / 10.4)


def test_the_largest_batch_part_on_a_fake_gpu(bench, monkeypatch):
    fake = _FakeTraining(capacity=80.0, seconds=10.0)
    monkeypatch.setattr(e2e_bench, "run_method", fake)
    monkeypatch.setattr(bench, "free_memory", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80 * 2**30))
    args = bench.parse_args(["--device", "cpu", "--budgets", "0.5", "--no-fp8", "--largest-compile", "static"])
    args.device = "cuda"  # after the checks: this machine has none
    results = [bench.run_one(bench._e2e_config(args, 256, 8, args.methods), m) for m in args.methods]
    rows = bench.curve_rows(results)
    payload, saves = {"largest_batch": {}}, []
    bench.largest_part(args, results, rows, fake.clock, 10**6, payload, lambda: saves.append(1))
    part = payload["largest_batch"]
    assert part["best"]["method"] == "gem-memory-budget-0.5"
    gem, best = part["methods"]
    # gem: peak 10 + 0.1 B fits up to B 700: 512 fits, 1024 not, 768 not, 640 fits; 256 known from the curve
    assert [(t["batch"], t["outcome"]) for t in gem["tries"]] == [(512, "fits"), (1024, "oom"), (768, "oom"),
                                                                  (640, "fits")]
    assert gem["start_known_from_curve"] and (gem["largest_fit"], gem["smallest_oom"]) == (640, 768)
    assert gem["at_largest"]["peak_memory_gib"] == pytest.approx(74.0)
    assert gem["at_largest"]["source"] == "try" and gem["at_largest"]["mfu"] == 0.2
    assert abs(gem["linear_estimate"]["batch_at_device_memory"] - 700) <= 1
    assert best["largest_fit"] == 1280 and best["largest_fit_ratio_vs_gem"] == pytest.approx(2.0)
    assert len(saves) == len(gem["tries"]) + len(best["tries"]) + 2  # after every try and every method
    assert all(r["outcome"] in ("fits", "oom") and r["batch_size"] for r in gem["try_results"])


class _FakeDynamicPrograms:
    """e2e_bench.start_method / measure stand-ins over _FakeTraining: records each program started (method,
    dynamic_batch) and each (method, batch) measured in one."""

    def __init__(self, monkeypatch):
        self.fake = _FakeTraining(capacity=80.0, seconds=10.0)
        self.started, self.measured = [], []
        monkeypatch.setattr(e2e_bench, "start_method", self.start_method)
        monkeypatch.setattr(e2e_bench, "measure", self.measure)

    def start_method(self, cfg, method, dynamic_batch=False):
        self.started.append((method, dynamic_batch))
        return SimpleNamespace(method=method, batch=cfg.batch_size, at_batch=functools.partial(self._at, method))

    def _at(self, method, cfg):
        return SimpleNamespace(method=method, batch=cfg.batch_size)

    def measure(self, run):
        self.measured.append((run.method, run.batch))
        return self.fake(SimpleNamespace(batch_size=run.batch), run.method)


def test_the_dynamic_search_compiles_once_per_method_and_keeps_going_after_an_oom(bench, monkeypatch):
    """--largest-compile dynamic: one start_method per method (one program), every try measured in it at its
    own batch; an OOM is an answer and the next try runs in the same program; the start batch is tried
    (the curve's static row does not describe the dynamic program)."""
    programs = _FakeDynamicPrograms(monkeypatch)
    fake, started, measured = programs.fake, programs.started, programs.measured
    monkeypatch.setattr(bench, "free_memory", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    args = bench.parse_args(["--device", "cpu", "--parts", "largest", "--largest-methods", "gem",
                             "--largest-compile", "dynamic"])
    args.device = "cuda"
    payload = {"largest_batch": {}}
    bench.largest_part(args, [], [], fake.clock, 10**6, payload, lambda: None)
    (gem,) = payload["largest_batch"]["methods"]
    assert started == [("gem", True)]  # one dynamic-batch program for the whole search
    assert [b for _, b in measured] == [256, 512, 1024, 768, 640]
    assert (gem["largest_fit"], gem["smallest_oom"], gem["compile"]) == (640, 768, "dynamic")
    assert not gem["start_known_from_curve"]
    assert all(r["compile"] == "dynamic batch" for r in gem["try_results"])


def test_together_measures_the_curve_row_and_the_search_in_one_program_per_method(bench, monkeypatch):
    programs = _FakeDynamicPrograms(monkeypatch)
    fake, started, measured = programs.fake, programs.started, programs.measured
    monkeypatch.setattr(bench, "free_memory", lambda device: None)
    monkeypatch.setattr(bench, "rewrite_results", lambda path, payload: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    args = bench.parse_args(["--device", "cpu", "--together", "--budgets", "0.5", "--no-fp8",
                             "--largest-methods", "gem,gem-memory-budget-0.5", "--methods",
                             "gem,gem-memory-budget-0.5,inductor"])
    args.device = "cuda"
    payload = {"largest_batch": {}, "curve": {}}
    results = bench.together_part(args, payload, lambda: None, fake.clock, log=lambda *a: None)
    # one dynamic-batch program per method
    assert started == [("gem", True), ("gem-memory-budget-0.5", True), ("inductor", True)]
    assert [r["outcome"] for r in results] == ["fits"] * 3
    gem, budget = payload["largest_batch"]["methods"]
    # the curve's row (B 256) is the search's start, measured in the same program: not tried again
    assert gem["start_known_from_curve"] and measured.count(("gem", 256)) == 1
    assert (gem["largest_fit"], gem["smallest_oom"]) == (640, 768)
    assert budget["largest_fit"] == 1280 and budget["largest_fit_ratio_vs_gem"] == pytest.approx(2.0)
    assert ("inductor", 512) not in measured  # not among --largest-methods


def test_together_refuses_best(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--together"])


def test_memory_snapshot_flag_reaches_the_curve_rows_only_and_is_printed(bench, tmp_path, monkeypatch, capsys):
    """--memory-snapshot: E2EBenchConfig.memory_snapshot on the curve's config (not the largest-batch tries),
    the row's memory_snapshot kept in the JSON, its top groups printed after the table."""
    monkeypatch.delenv("OUT", raising=False)
    fake = _FakeTraining()
    snapshots = []
    summary = {"peak_allocated_gib": 1.5, "max_memory_allocated_gib": 1.5, "step_error": None, "truncated": False,
               "before_step": {"gib": 0.5},
               "at_peak": {"before_step_gib": 0.5, "step_gib": 1.0, "step_count": 3,
                           "by_kind_gib": {"inductor_buffers": 1.0},
                           "groups": [{"where": "inductor kernel buffer cxyz.py:42", "via": None, "gib": 1.0,
                                       "count": 3}]}}

    def run_method(cfg, method, log=print):
        snapshots.append(cfg.memory_snapshot)
        return {**fake(cfg, method, log), "memory_snapshot": summary if cfg.memory_snapshot else None}

    monkeypatch.setattr(e2e_bench, "run_method", run_method)
    assert bench.parse_args(["--device", "cpu"]).memory_snapshot is False
    payload = bench.main(["--size", "tiny", "--batch-size", "4", "--device", "cpu", "--methods", "gem,inductor",
                          "--memory-snapshot", "--out", str(tmp_path)], clock=fake.clock)
    assert snapshots == [True, True] and payload["args"]["memory_snapshot"] is True
    assert payload["curve"]["config"]["memory_snapshot"] is True
    assert payload["curve"]["results"][0]["memory_snapshot"]["peak_allocated_gib"] == 1.5
    out = capsys.readouterr().out
    assert "memory snapshot: peak 1.50 GiB" in out and "inductor kernel buffer cxyz.py:42" in out
    args = bench.parse_args(["--device", "cpu", "--memory-snapshot"])
    assert bench._e2e_config(args, 512, 3, ["gem"]).memory_snapshot is False  # a try of the search: no snapshot
