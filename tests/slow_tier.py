"""The slow tier: tests measured slow on CI's 2-core CPU run only when asked for.

CI (README's test command, 2 cores, 25 minutes) runs the fast tier. The tests listed in
``tests/slow_tests.json`` (measured at or above its threshold in a cold CI run) are skipped there with their
time in the reason, the way PyTorch keeps its measured slow tests out of its default CI jobs. Tests marked
``@pytest.mark.core`` (the whole-model and multi-process end-to-end runs) stay in the fast tier whatever
they cost, and the list keeps every test file's cheapest test in the fast tier.

    GEMCOMPILE_SLOW_TESTS unset or 0: the fast tier; 1: every test; only: the slow tier alone

Regenerate the list from CI logs run with ``--durations=0`` (a test's longest time among them counts: a
test that paid for a compile a listed test used to pay shows up in the next run):

    python tests/slow_tier.py CI_LOG [CI_LOG ...] [--threshold-s 5]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path

LIST = Path(__file__).with_name("slow_tests.json")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:call|setup|teardown)\s+(\S+)")


def mode() -> str:
    value = os.environ.get("GEMCOMPILE_SLOW_TESTS", "0")
    return {"0": "fast", "": "fast", "1": "all", "only": "slow"}.get(value, "all")


def slow_tests() -> dict[str, float]:
    return json.loads(LIST.read_text())["tests"] if LIST.exists() else {}


def select(items, pytest) -> None:
    """Skip the items outside the tier GEMCOMPILE_SLOW_TESTS asks for (called at collection)."""
    which = mode()
    if which == "all":
        return
    listed = slow_tests()
    for item in items:
        seconds = None if item.get_closest_marker("core") else listed.get(item.nodeid)
        if which == "fast" and seconds is not None:
            item.add_marker(pytest.mark.skip(reason=(
                f"slow tier: {seconds:.0f} s on CI's 2-core CPU (tests/slow_tests.json); "
                "GEMCOMPILE_SLOW_TESTS=1 runs it")))
        # tests marked slow decide for themselves in the fast tier (some gate on GEMCOMPILE_SLOW_TESTS); with
        # "only" they count as the slow tier
        elif which == "slow" and seconds is None and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="fast tier (GEMCOMPILE_SLOW_TESTS=only runs the slow tier)"))


def durations(log: str) -> dict[str, float]:
    """Seconds per test id (setup, call and teardown summed) from pytest's --durations=0 report."""
    total: dict[str, float] = collections.defaultdict(float)
    for line in log.splitlines():
        if m := _DURATION.match(line.strip()):
            total[m.group(2)] += float(m.group(1))
    return dict(total)


def slow_list(times: dict[str, float], threshold_s: float) -> dict[str, float]:
    """Tests at or above the threshold, less each file's cheapest test where all of a file's tests are."""
    by_file: dict[str, list[str]] = collections.defaultdict(list)
    for test in times:
        by_file[test.split("::")[0]].append(test)
    slow = {}
    for tests in by_file.values():
        over = sorted((t for t in tests if times[t] >= threshold_s), key=lambda t: times[t])
        if len(over) == len(tests):
            over = over[1:]
        slow.update({t: round(times[t], 1) for t in over})
    return dict(sorted(slow.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="CI logs with pytest's --durations=0 report")
    parser.add_argument("--threshold-s", type=float, default=5.0)
    args = parser.parse_args()
    times: dict[str, float] = {}
    for log in args.logs:
        measured = durations(Path(log).read_text())
        if not measured:
            raise SystemExit(f"{log}: no --durations=0 lines")
        times.update({t: max(s, times.get(t, 0.0)) for t, s in measured.items()})
    slow = slow_list(times, args.threshold_s)
    LIST.write_text(json.dumps({"threshold_s": args.threshold_s, "measured": f"cold CI runs ({len(args.logs)}), 2-core CPU, -n 2",
                                "tests": slow}, indent=1) + "\n")
    print(f"{len(slow)} of {len(times)} timed tests, {sum(slow.values()):.0f} of {sum(times.values()):.0f} "
          f"worker-seconds -> {LIST} (those marked core among them stay in the fast tier)")


if __name__ == "__main__":
    main()
