"""The training summary's numbers: FLOPs in the largest unit, and "n/a" where none were measured (a run
resumed at or past its last step trains nothing, and its FLOPs per step are NaN)."""

import pytest

from gemcompile.runtime.training.report import _fmt_flops


@pytest.mark.parametrize("value, text", [
    (2.5e12, "2.500 TFLOP"), (3e15, "3.000 PFLOP"), (4.2e6, "4.200 MFLOP"), (12.0, "12 FLOP"),
    (float("nan"), "n/a"), (None, "n/a"),
])
def test_flops_are_written_in_their_unit_or_as_not_measured(value, text):
    assert _fmt_flops(value) == text
