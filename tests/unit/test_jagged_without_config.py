"""benchmarks/jagged_without_config.py: the configs it is told to drop leave the kernel's autotune list, and a
config that is not listed (or the last one) stops it with a message instead of timing the unchanged list."""

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton")


def test_a_listed_config_is_dropped_and_a_missing_one_is_refused(monkeypatch):
    from gemcompile.lowering.jagged_attention import triton as kernels

    import triton

    script = load_benchmark("jagged_without_config")
    keep = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3)
    drop = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
    drop_tma = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2, pre_hook=lambda args: None)
    monkeypatch.setattr(kernels._bwd_dq_kernel, "configs", [keep, drop, drop_tma])
    assert script.drop_configs(["dq:64,64,4,2"]) == "autotune lists without dq:64,64,4,2"
    assert kernels._bwd_dq_kernel.configs == [keep]  # both variants of the dropped shape
    with pytest.raises(SystemExit, match="no such config"):
        script.drop_configs(["dkdv:7,7,1,1"])
    with pytest.raises(SystemExit, match="one of"):
        script.drop_configs(["attn:64,64,4,2"])
    monkeypatch.setattr(kernels._fwd_kernel, "configs", kernels._fwd_kernel.configs[:1])
    only = kernels._fwd_kernel.configs[0]
    with pytest.raises(SystemExit, match="only config"):
        script.drop_configs(["fwd:" + ",".join(map(str, (only.kwargs["BLOCK_M"], only.kwargs["BLOCK_N"],
                                                            only.num_warps, only.num_stages)))])
