"""Golden test: what the passes rewrite and refuse on GEM-ref, site by site, stays as recorded.

A refactor of the passes must not change a decision. The records under tests/golden/ hold, for each
rewrite, the pass, the user's source line, the detail and the gemcompile ops it emitted; for each
refusal, the pass, the source line and the reason. A change in behaviour that is meant is recorded
again with ``GEMCOMPILE_UPDATE_GOLDEN=1 python -m pytest tests/integration/test_explain_golden.py``,
and the diff of the JSON shows it in review.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gemcompile import GemConfig
from gemcompile.cli import explain_gem_ref

GOLDEN = Path(__file__).parent.parent / "golden"
_EMITTED_OP = re.compile(r"gemcompile\.(\w+)\.")


def _site(record) -> dict:
    location = record.location
    return {"pass": record.pass_name, "stage": record.stage,
            "function": location.function if location else None,
            "code": location.code if location else None}


def decisions(report) -> dict:
    """The report as plain values: counts, then every rewrite and refusal in the order they were made."""
    return {
        "counts": dict(sorted(report.counts.items())),
        "rewrites": [_site(r) | {"detail": r.detail, "emits": sorted(set(_EMITTED_OP.findall(r.after)))}
                     for r in report.rewrites],
        "refusals": [_site(r) | {"reason": r.reason} for r in report.refusals],
    }


@pytest.mark.parametrize("size,config", [
    ("tiny", {}),
    ("small", {}),
    ("tiny", {"mxfp8": {"enabled": True}}),
], ids=["tiny", "small", "tiny-mxfp8"])
def test_explain_gem_ref_makes_the_recorded_decisions(size, config):
    report, _ = explain_gem_ref(size, config=GemConfig(**config))
    got = decisions(report)
    name = size + "".join(f"-{section}" for section in config) + ".json"
    path = GOLDEN / f"explain-gem-ref-{name}"
    if os.environ.get("GEMCOMPILE_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    assert got["counts"] == want["counts"]
    assert len(got["rewrites"]) == len(want["rewrites"]) and len(got["refusals"]) == len(want["refusals"])
    for i, (g, w) in enumerate(zip(got["rewrites"], want["rewrites"])):
        assert g == w, f"rewrite {i} changed"
    for i, (g, w) in enumerate(zip(got["refusals"], want["refusals"])):
        assert g == w, f"refusal {i} changed"
