"""The decode cost table by batch size (decode_costs.py) and the group bound that reads it: many wide
steps do not push out what a narrow step costs, and one slow narrow step does not open the bound."""

from __future__ import annotations

import pytest

from infer.core.decode_costs import SAMPLES, DecodeCosts
from infer.core.group_decode_bound import GroupDecodeBound
from infer.core.prefill_pacer import PrefillPacer


def test_sizes_measured_interpolated_and_extrapolated():
    costs = DecodeCosts()
    assert not costs and costs.seconds(4) is None
    for rows, seconds in [(2, 0.012), (2, 0.014), (2, 0.013), (10, 0.020), (30, 0.040)]:
        costs.add(rows, seconds)
    assert costs.seconds(2) == pytest.approx(0.013)  # the median of its steps
    assert costs.seconds(6) == pytest.approx(0.0165)  # on the line between 2 and 10
    assert costs.seconds(1) == pytest.approx(0.012125)  # the line through the two smallest, extended
    assert costs.seconds(60) == pytest.approx(0.080)  # past the largest: scaled by rows
    assert costs.above(0)[-1][0] == 30  # the largest size measured
    assert costs.measured(8, 12) and not costs.measured(11, 29)
    assert costs.above(10) == [(30, pytest.approx(0.040))]


def test_a_size_keeps_its_latest_steps_only():
    costs = DecodeCosts()
    for _ in range(SAMPLES):
        costs.add(4, 1.0)
    for _ in range(SAMPLES // 2 + 1):
        costs.add(4, 0.01)  # the machine got faster: a majority of the latest steps says so
    assert costs.seconds(4) == pytest.approx(0.01)


def test_a_flood_of_wide_steps_keeps_the_narrow_cost_and_one_slow_narrow_step_changes_nothing():
    pacer = PrefillPacer(2.0)
    for _ in range(SAMPLES):
        pacer.decode_costs.add(1, 0.014)  # a stream alone
    for _ in range(200):
        pacer.decode_costs.add(136, 0.110)  # then a flood of 135 choices beside it, for long
    pacer.decode_costs.add(1, 0.067)  # and one stalled step of the stream alone
    # 0.014 + 0.000711 a row: at most 10 rows in 1.5 x 0.014; a slow step as the base would allow over 100
    assert GroupDecodeBound(pacer).rows_allowed(1) == 9
