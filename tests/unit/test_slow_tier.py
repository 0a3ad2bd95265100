"""tests/slow_tier.py: the slow list from a --durations=0 report, and which tier a test lands in."""
import types

import pytest

from tests import slow_tier

LOG = """
============================= slowest durations ==============================
12.50s call     tests/integration/test_a.py::test_big[x]
0.50s setup    tests/integration/test_a.py::test_big[x]
3.00s call     tests/integration/test_a.py::test_small
9.00s call     tests/unit/test_b.py::test_one
7.00s call     tests/unit/test_b.py::test_two
"""


def test_durations_sum_the_phases_of_a_test():
    times = slow_tier.durations(LOG)
    assert times["tests/integration/test_a.py::test_big[x]"] == pytest.approx(13.0)
    assert len(times) == 4


def test_the_list_keeps_each_files_cheapest_test_in_the_fast_tier():
    slow = slow_tier.slow_list(slow_tier.durations(LOG), threshold_s=5)
    assert slow == {"tests/integration/test_a.py::test_big[x]": 13.0, "tests/unit/test_b.py::test_one": 9.0}


def _item(nodeid, *markers):
    added = []
    return types.SimpleNamespace(nodeid=nodeid, added=added, add_marker=added.append,
                                 get_closest_marker=lambda name: name if name in markers else None)


@pytest.mark.parametrize("env,skipped", [(None, {"listed"}), ("1", set()), ("only", {"fast", "core"})])
def test_the_tier_each_setting_runs(monkeypatch, env, skipped):
    monkeypatch.setattr(slow_tier, "slow_tests", lambda: {"t::listed": 9.0, "t::core": 60.0})
    if env is None:
        monkeypatch.delenv("GEMCOMPILE_SLOW_TESTS", raising=False)
    else:
        monkeypatch.setenv("GEMCOMPILE_SLOW_TESTS", env)
    items = {"listed": _item("t::listed"), "core": _item("t::core", "core"), "marked": _item("t::marked", "slow"),
             "fast": _item("t::fast")}
    slow_tier.select(list(items.values()), pytest)
    assert {name for name, item in items.items() if item.added} == skipped
    if env is None:
        assert "9 s on CI" in items["listed"].added[0].kwargs["reason"]
