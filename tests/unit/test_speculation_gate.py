"""The speculation gate (infer/core/speculation_gate.py): which steps get proposals, from the step costs
and yields given to it (in an engine, from its own steps: tests/engine/test_spec_decode.py)."""

from __future__ import annotations

from infer.core.speculation_gate import MIN_PLAIN, MIN_VERIFY, PROBE_EVERY, SpeculationGate


def measured(gate: SpeculationGate, batch: int, plain_s: float, verify_s: float, tokens: float) -> None:
    for _ in range(max(MIN_PLAIN, MIN_VERIFY)):
        gate.observe(batch, False, plain_s, batch)
        gate.observe(batch, True, verify_s, round(tokens * batch))


def decisions(gate: SpeculationGate, running: int, decoding: int, n: int) -> list[bool]:
    return [gate.speculate(running, decoding) for _ in range(n)]


def test_it_speculates_to_measure_then_decodes_plainly_to_measure_then_judges():
    gate = SpeculationGate(max_batch=4)
    for _ in range(MIN_VERIFY):
        assert gate.speculate(1, 1)  # nothing measured: speculate, to measure verification steps
        gate.observe(1, True, 0.012, 1)  # nothing accepted
    for _ in range(MIN_PLAIN):
        assert not gate.speculate(1, 1)  # then plain steps, to measure those
        gate.observe(1, False, 0.010, 1)
    # 1 token a request for 1.2x a plain step's cost: off, but for one probe in PROBE_EVERY decisions
    made = decisions(gate, 1, 1, 4 * PROBE_EVERY)
    assert made.count(True) == 4 and not any(made[: PROBE_EVERY - 1])


def test_it_speculates_where_the_accepted_tokens_pay_for_the_verification():
    gate = SpeculationGate(max_batch=4)
    measured(gate, 1, plain_s=0.010, verify_s=0.013, tokens=2.0)  # 2 tokens for 1.3x: pays
    made = decisions(gate, 1, 1, 2 * PROBE_EVERY)
    assert made.count(False) == 2  # the probes of plain steps, no more
    assert gate.pays(1)


def test_each_batch_size_is_judged_on_its_own_costs():
    gate = SpeculationGate(max_batch=4)
    measured(gate, 1, plain_s=0.010, verify_s=0.012, tokens=1.5)  # 1.5 tokens for 1.2x: pays
    measured(gate, 4, plain_s=0.012, verify_s=0.030, tokens=1.5)  # 1.5 tokens for 2.5x: loses
    assert gate.pays(1) and not gate.pays(4)
    assert sum(decisions(gate, 1, 1, PROBE_EVERY - 1)) == PROBE_EVERY - 1
    assert sum(decisions(gate, 4, 4, PROBE_EVERY - 1)) == 0
    assert gate.speculate(3, 3)  # a size not measured yet: speculate, to measure it


def test_the_cap_holds_whatever_was_measured_and_the_gate_can_be_turned_off():
    gate = SpeculationGate(max_batch=2)
    measured(gate, 1, plain_s=0.010, verify_s=0.030, tokens=1.0)  # loses
    assert not gate.speculate(3, 1)  # three running: over the cap, whatever the decodes
    assert not any(decisions(gate, 1, 1, PROBE_EVERY - 1))
    ungated = SpeculationGate(max_batch=2, by_gain=False)
    measured(ungated, 1, plain_s=0.010, verify_s=0.030, tokens=1.0)
    assert all(decisions(ungated, 1, 1, 2 * PROBE_EVERY)) and not ungated.speculate(3, 3)


def test_the_yield_is_the_latest_verifications_tokens_per_request():
    gate = SpeculationGate(max_batch=4)
    measured(gate, 2, plain_s=0.010, verify_s=0.014, tokens=1.0)
    assert not gate.pays(2)
    for _ in range(8):  # the text starts repeating itself: 3 tokens a request per verification
        gate.observe(2, True, 0.014, 6)
    assert gate.tokens_per_verification() == 3.0 and gate.pays(2)
