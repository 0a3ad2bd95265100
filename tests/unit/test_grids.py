"""tests/grids.pairwise: every pair of values of any two axes in some case, each case from the product."""
import itertools

import pytest

from tests.grids import pairwise


@pytest.mark.parametrize("sizes", [(5, 3, 3), (2, 2, 2), (3, 4, 2, 3), (1, 3, 2), (7, 2, 2)])
def test_every_pair_is_covered_by_cases_of_the_product(sizes, monkeypatch):
    monkeypatch.delenv("GEMCOMPILE_FULL_GRIDS", raising=False)
    axes = [[f"a{i}v{j}" for j in range(n)] for i, n in enumerate(sizes)]
    cases = pairwise(*axes)
    product = set(itertools.product(*axes))
    assert set(cases) <= product and len(set(cases)) == len(cases)
    for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
        for x, y in itertools.product(a, b):
            assert any(c[i] == x and c[j] == y for c in cases), (x, y)
    top_two = sorted(sizes)[-2:]
    assert len(cases) < len(product) or len(product) == top_two[0] * top_two[1]


def test_the_full_grid_on_request_and_for_two_axes(monkeypatch):
    monkeypatch.delenv("GEMCOMPILE_FULL_GRIDS", raising=False)
    assert len(pairwise([1, 2, 3], "ab")) == 6
    assert len(pairwise(range(5), range(3), range(3))) < 45
    monkeypatch.setenv("GEMCOMPILE_FULL_GRIDS", "1")
    assert len(pairwise(range(5), range(3), range(3))) == 45


def test_an_empty_axis_is_an_error():
    with pytest.raises(ValueError, match="at least one value"):
        pairwise([1, 2], [], [3])


def test_mapping_axes_name_the_cases(monkeypatch):
    monkeypatch.delenv("GEMCOMPILE_FULL_GRIDS", raising=False)
    cases = pairwise({"fp32": 4, "fp16": 2}, {"full": False, "causal": True}, ["a", "b", "c"])
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids) == len(cases) and "fp32-full-a" in ids
    assert all(len(c.values) == 3 and c.values[0] in (4, 2) for c in cases)
