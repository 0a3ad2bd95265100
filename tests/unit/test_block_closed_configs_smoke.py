"""benchmarks/block_closed_configs.py --smoke: every candidate config of the closed kernels, pinned one kernel
at a time, under the Triton interpreter against the float64 reference (what the GPU sweep then times)."""

import os

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the smoke path runs the kernels under the Triton interpreter", allow_module_level=True)


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("block_closed_configs")


def test_every_candidate_config_matches_the_reference(sweep):
    args = type("Args", (), {"smoke": True, "head_dim": 32, "rotary": ["half"], "budget_s": 1e9, "out": None,
                         "which": ["fwd", "bwd"], "only_with": None})
    payload = sweep.run(args)
    pinned = [r for r in payload["rows"] if r["pinned"] in ("fwd", "bwd")]
    # every EXTRA config of both kernels ran (the interpreter's lists hold no 64-row config of their own)
    assert len(pinned) == len(sweep.EXTRA["fwd"]) + len(sweep.EXTRA["bwd"])
    assert not [r for r in pinned if r.get("error") or r.get("skipped")]
    assert all(r["max_rel_err_vs_float64"] < sweep.SMOKE_TOL for r in pinned)
    assert all(r["closed_kernels"] for r in pinned)  # not the general kernels
