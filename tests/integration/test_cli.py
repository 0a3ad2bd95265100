"""The `gemcompile explain` and `gemcompile bench` commands."""

import json

import pytest
import torch

from gemcompile.cli import main
from gemcompile.runtime.training import e2e_bench

BENCH = ["bench", "e2e", "--size", "tiny", "--steps", "1", "--methods", "eager", "--kernel-steps", "0"]
"""A tiny bench run (with --device cpu: seconds)."""


def test_explain_gem_ref_tiny_prints_the_pma_rewrites(capsys):
    assert main(["explain", "--model", "gem-ref", "--size", "tiny", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "GEM-ref tiny" in out and "jagged_attention" in out
    assert "F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])" in out
    assert "gemcompile.jagged_attention.default" in out
    assert "gemcompile.block_attention.default" in out  # the block-diagonal self-attention, RoPE fused
    assert "rotary half fused" in out


def test_explain_with_the_pass_disabled(capsys):
    assert main(["explain", "--size", "tiny", "--disable", "jagged_attention", "--disable", "gdpa",
                 "--disable", "block_attention", "--disable", "unpad", "--disable", "table_batching",
                 "--width", "200"]) == 0
    assert "0 rewrites" in capsys.readouterr().out
    assert main(["explain", "--size", "tiny", "--disable", "jagged_attention", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "gemcompile.gdpa.default" in out and "gemcompile.jagged_attention.default" not in out


def test_explain_rejects_an_unknown_pass(capsys):
    assert main(["explain", "--size", "tiny", "--disable", "jaged_attention"]) == 2
    err = capsys.readouterr().err
    assert "unknown pass" in err and "jagged_attention" in err and "Traceback" not in err


def test_explain_with_a_default_off_pass_enabled(capsys):
    """--enable mxfp8: the post-grad pass reports every GEMM of GEM-ref (tiny: all below the size gates)."""
    assert main(["explain", "--size", "tiny", "--enable", "mxfp8", "--width", "200"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("│ mxfp8"))
    assert "yes" in row and int(row.split("│")[-2]) > 0  # refusals, each a GEMM with its reason
    assert "below" in out or "min" in out
    assert main(["explain", "--size", "tiny", "--enable", "mxfp9"]) == 2


def test_explain_refuses_a_bad_memory_budget_and_memory_is_not_a_pass(capsys):
    assert main(["explain", "--size", "tiny", "--memory-budget", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "MemoryConfig.budget = 1.5" in err and "(0, 1]" in err and "Traceback" not in err
    assert main(["explain", "--size", "tiny", "--disable", "memory"]) == 2
    assert "unknown pass" in capsys.readouterr().err


def test_explain_refuses_a_width_the_report_cannot_use(capsys):
    """--width 0 printed nothing and exited 0; --width 1000000 wrote every line a million columns wide."""
    for width in ("0", "-5", "1000000"):
        assert main(["explain", "--size", "tiny", "--width", width]) == 2
        err = capsys.readouterr().err
        assert f"--width {width}" in err and "40 to 1000" in err and "Traceback" not in err


def test_explain_refuses_a_pass_both_disabled_and_enabled(capsys):
    """The last flag won, silently."""
    assert main(["explain", "--size", "tiny", "--disable", "gdpa", "--enable", "gdpa"]) == 2
    err = capsys.readouterr().err
    assert err == ("gemcompile explain: error: --disable gdpa and --enable gdpa: a pass is either enabled or "
                   "disabled\n")


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "-4"], "E2EBenchConfig.batch_size = -4: need >= 1"),  # every method failed, exit 0
    (["--batch-size", "0"], "E2EBenchConfig.batch_size = 0: need >= 1"),  # ran 64, the results said 0
    (["--methods", ","], "E2EBenchConfig.methods is empty"),  # ran nothing, printed nothing, exit 0
    (["--seed", str(2**64)], "E2EBenchConfig.seed = 18446744073709551616: need an int in [0, 2**63)"),
])
def test_bench_refuses_a_bad_config_in_one_line(flags, message, tmp_path, capsys):
    assert main([*BENCH, "--device", "cpu", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemcompile bench: error: {message}") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_on_cuda_without_a_gpu_is_one_error_line(capsys):
    """The default --device cuda printed a CUDA traceback per method and exited 0."""
    assert main(BENCH) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemcompile bench: error: --device cuda: no CUDA device is available") and (
        len(err.splitlines()) == 1)


def test_bench_fails_when_every_method_failed(monkeypatch, tmp_path, capsys):
    """Nothing measured is not a success; the results JSON keeps each method's error."""
    def broken(cfg, method, log):
        raise RuntimeError(f"{method} broke")

    monkeypatch.setattr(e2e_bench, "run_method", broken)
    assert main([*BENCH, "--methods", "eager,inductor", "--device", "cpu", "--out", str(tmp_path)]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "gemcompile bench: error: every method failed: eager, inductor (each error is above)"
    (results,) = tmp_path.glob("*.json")
    errors = [r["error"] for r in json.loads(results.read_text())["results"]]
    assert errors == ["RuntimeError: eager broke", "RuntimeError: inductor broke"]
