"""masks/linear.py: which sets of integer comparisons can hold together (the prover's last check)."""

import sympy

from gemcompile.passes.masks.evaluator import index_symbol
from gemcompile.passes.masks.linear import feasible

I, J = index_symbol(1), index_symbol(0)
N = sympy.Function("len_n")(index_symbol(3))
INDICES = {index_symbol(k) for k in range(4)}


def test_i_equals_j_below_and_above_a_length_is_impossible():
    # i == j, i < n, j >= n
    assert not feasible([("eq", I - J, True), ("lt", I - N, True), ("lt", J - N, False)], INDICES)


def test_a_consistent_set_is_feasible():
    assert feasible([("eq", I - J, True), ("lt", I - N, True), ("lt", J - N, True)], INDICES)


def test_a_negated_equality_branches_both_ways():
    # i != j with i <= j <= i: impossible; i != j with i < j + 2: possible
    assert not feasible([("eq", I - J, False), ("lt", I - J - 1, True), ("lt", J - I - 1, True)], INDICES)
    assert feasible([("eq", I - J, False), ("lt", I - J - 2, True)], INDICES)


def test_indices_are_nonnegative_and_nonlinear_terms_are_unknown():
    assert not feasible([("lt", I, True)], INDICES)  # i < 0 for an index
    assert feasible([("lt", sympy.floor(I / 4) - J, True), ("lt", J, True)], INDICES)  # floor: not judged


def test_lengths_and_target_counts_together():
    # HSTU's target rows: j >= n - t, i < n - t, i == j is impossible once t >= 0; possible with t < 0 allowed
    t = sympy.Function("len_t")(index_symbol(3))
    facts = [("eq", I - J, True), ("lt", J - (N - t), False), ("lt", I - (N - t), True)]
    assert not feasible(facts, INDICES)
    assert feasible(facts[:2] + [("lt", I - N - 2 * t, True)], INDICES)  # another form: i < n + 2t is possible
    assert not feasible(facts + [("lt", t, False)], INDICES)


def test_coefficients_are_exact_and_fractional_ones_unknown():
    # 2i < 3 and i >= 1 hold at i = 1; 2i < 1 and i >= 1 do not; i / 2 < 1 is not integer-valued: unknown
    assert feasible([("lt", 2 * I - 3, True), ("lt", I - 1, False)], INDICES)
    assert not feasible([("lt", 2 * I - 1, True), ("lt", I - 1, False)], INDICES)
    assert feasible([("lt", I / 2 - 1, True), ("lt", I - 1, False)], INDICES)
