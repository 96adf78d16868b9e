"""tests/grids.py: a grid's fast cases hold every pair of values, the two tiers every case once."""

from __future__ import annotations

import itertools

import pytest

from tests.grids import first_fast, pairwise_grid


def test_the_fast_cases_cover_every_pair_and_the_tiers_every_case():
    axes = [[pytest.param("f32", id="fp32"), pytest.param("b16", id="bf16")], [1, 2, 4], [64, 128], [None, 9]]
    cases = pairwise_grid(*axes, [1, 2, 7, 33])
    values = [[1, 2, 4], [64, 128], [None, 9], [1, 2, 7, 33]]
    full = list(itertools.product(["f32", "b16"], *values))
    assert [case.values for case in cases] == full  # each case once, in product order
    fast = [case.values for case in cases if not case.marks]
    slow = [case.values for case in cases if [m.name for m in case.marks] == ["slow"]]
    assert len(fast) + len(slow) == len(full) and len(fast) < len(full) // 4
    for a, b in itertools.combinations(range(5), 2):
        assert {(c[a], c[b]) for c in fast} == {(c[a], c[b]) for c in full}, (a, b)
    assert cases[0].id == "fp32-1-64-None-1"  # as stacked parametrize decorators name it


def test_one_axis_is_all_fast_and_first_fast_keeps_the_first():
    assert all(not case.marks for case in pairwise_grid([1, 2, 3]))
    first, *rest = first_fast(["default", "odd", "none"])
    assert first == "default" and all(p.marks[0].name == "slow" for p in rest)
    with pytest.raises(TypeError, match="pytest.param"):
        pairwise_grid([object()], [1])
