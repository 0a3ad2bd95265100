"""The `gemcompile explain` command."""

from gemcompile.cli import main


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
