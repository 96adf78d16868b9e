"""A group's decode rows beside other requests are bounded by the step's cost (group_decode_bound.py):
the step of a stream beside 64 choices of one request costs at most max_decode_slowdown x the stream's
step alone, the group's rows rotate so every choice progresses and completes, and a group alone runs at
its full width. Steps are timed by a simulated cost (no wall clock)."""

from __future__ import annotations

import pytest

from infer.config import CacheConfig, SchedulerConfig
from infer.core.group_decode_bound import PROBE_EVERY, GroupDecodeBound
from infer.core.prefill_pacer import PrefillPacer
from infer.core.scheduler import Scheduler
from tests.unit.core_fakes import FakeRunner, make_request, step

READ_S, ROW_S = 0.010, 0.001  # a decode step: one read of the weights, then per row


def step_seconds(out) -> float:
    return READ_S + ROW_S * out.num_batched_tokens


def scheduler(slowdown: float = 2.0) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=80, max_num_batched_tokens=256, max_model_len=1024, max_decode_slowdown=slowdown
    )
    return Scheduler(cfg, CacheConfig(num_blocks=4096, block_size=16))


def group(name: str, n: int, max_tokens: int, prompt_len: int = 4) -> list:
    reqs = [make_request(f"{name}-{i}", prompt_len, max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    for req in reqs:
        req.group_id = name
    return reqs


def run(s: Scheduler, arrivals: dict[int, list], on_step=None, max_steps: int = 20_000) -> set[str]:
    runner, done = FakeRunner(s), set()
    for k in range(max_steps):
        for req in arrivals.get(k, []):
            s.add_request(req)
        if not s.has_unfinished():
            return done
        out, outputs = step(s, runner)
        s.observe_step(out.num_batched_tokens, step_seconds(out))
        if on_step is not None:
            on_step(k, out)
        done |= {o.req_id for o in outputs if o.finished}
    raise AssertionError("did not finish")


@pytest.mark.parametrize("own_group", [False, True])  # a client's only request, in its client's group
def test_a_streams_step_beside_a_group_costs_at_most_twice_its_own_and_every_choice_completes(own_group):
    s = scheduler()
    choices = group("n", 64, max_tokens=300)
    bystander = make_request("bystander", 4, max_tokens=200, ignore_eos=True)
    bystander.group_id = "its own" if own_group else None
    beside, spread = [], []

    def on_step(k, out):
        ids = {x.req_id for x in out.scheduled}
        if "bystander" in ids and all(x.start_pos > 0 for x in out.scheduled if x.req_id == "bystander"):
            beside.append(step_seconds(out))
        made = [r.num_output_tokens for r in s.running if r.group_id == "n" and not r.is_prefill]
        if made:
            spread.append(max(made) - min(made))

    done = run(s, {0: choices, 3: [bystander]}, on_step)
    assert done == {r.req_id for r in choices} | {"bystander"}
    alone = READ_S + ROW_S
    # the first steps beside the group grow from twice the stream's rows (measured) up to the bound
    assert len(beside) == 199
    assert max(beside[2 * PROBE_EVERY :]) <= 2 * alone + 1e-9
    assert max(spread) <= 2  # the rows rotate: no choice runs ahead of the others


def test_without_a_bound_the_group_takes_every_step():
    s = scheduler(slowdown=0)
    choices = group("n", 64, max_tokens=40)
    widths = []
    run(
        s,
        {0: choices, 3: [make_request("bystander", 4, max_tokens=200, ignore_eos=True)]},
        lambda k, out: widths.append(len(out.scheduled)),
    )
    assert max(widths[5:]) == 65


def test_a_group_alone_runs_at_full_width():
    s = scheduler()
    widths = []
    run(s, {0: group("n", 64, max_tokens=20)}, lambda k, out: widths.append(len(out.scheduled)))
    assert min(widths) == 64


def test_the_step_that_admits_a_stream_is_bounded_too():
    s = scheduler()
    choices = group("n", 64, max_tokens=400)
    first = {}

    def on_step(k, out):
        for x in out.scheduled:
            if x.req_id == "bystander" and x.start_pos == 0:
                first["rows"] = len(out.scheduled) - 1

    run(s, {0: choices, 200: [make_request("bystander", 4, max_tokens=4, ignore_eos=True)]}, on_step)
    assert first["rows"] <= 5  # 10 ms + 1 ms a row: at most 6 rows in 1.5 x 11 ms


def test_the_rows_are_shared_alike_among_groups_and_go_to_those_that_ran_least():
    pacer = PrefillPacer(2.0)
    for n, t in [(1, 0.0085)] * 4 + [(21, 0.0185)] * 4:
        pacer.decode_costs.add(n, t)
    bound = GroupDecodeBound(pacer)
    assert bound.rows_allowed(1) == 8  # 0.008 + 0.0005 x 9 <= 1.5 x 0.0085
    a, b = group("a", 20, max_tokens=10), group("b", 3, max_tokens=10)
    for i, req in enumerate(a):
        req.output_token_ids = [1] * (i % 4)
    held, _ = bound.held_back(a + b, num_others=1)
    assert not held & set(b)  # the smaller group's 3 rows, the rest of 8 to the larger
    running_a = [r for r in a if r not in held]
    assert len(running_a) == 5
    assert {r.num_output_tokens for r in running_a} == {0}  # those that ran least


def test_no_measurement_of_the_others_alone_probes_them():
    pacer = PrefillPacer(2.0)
    for _ in range(8):
        pacer.decode_costs.add(64, 0.074)
    bound = GroupDecodeBound(pacer)
    rows = group("a", 64, max_tokens=10)
    assert bound.held_back(rows, num_others=1)[0] == set(rows)  # the others alone: measures them
    assert len(bound.held_back(rows, num_others=1)[0]) == 63  # till the next probe, twice their rows


def test_a_small_step_measured_slower_than_the_large_ones_keeps_the_safe_guess():
    pacer = PrefillPacer(2.0)
    pacer.decode_costs.add(2, 1.3)  # a stall of a busy machine
    for _ in range(8):
        pacer.decode_costs.add(129, 0.3)
    assert GroupDecodeBound(pacer).rows_allowed(1) == 1  # not all 128: the line is not to be trusted


def test_a_groups_new_sequences_beside_a_stream_enter_within_the_step_bound():
    """A stream running, then a group of 64 arrives: its admissions count in the step's rows like its
    decodes, a row per prompt token, so no step beside the stream costs more than twice the stream's
    alone, and all complete."""
    s = scheduler()
    stream = make_request("stream", 4, max_tokens=400, ignore_eos=True)
    widths, costs = [], []

    def on_step(k, out):
        if any(x.req_id == "stream" for x in out.scheduled):
            widths.append(sum(x.req_id != "stream" for x in out.scheduled))
            costs.append(step_seconds(out))

    done = run(s, {0: [stream], 40: group("n", 64, max_tokens=4)}, on_step)
    assert len(done) == 65
    assert 0 < max(widths) < 64
    assert max(costs) <= 2 * (READ_S + ROW_S) + 1e-9


@pytest.mark.parametrize("prompt_len", [4, 8])
def test_a_groups_admissions_count_a_row_per_prompt_token(prompt_len):
    """A group wider than the batch runs alone (its wide steps measured), then a stream joins: as the
    group's sequences finish, its next ones are admitted into the rows the bound leaves, a row per prompt
    token, so no step beside the stream costs more than twice the stream's alone (counting an admitted
    sequence as one row would let the group's prefills make such steps 2.5-3.5x)."""
    s = scheduler()
    stream = make_request("stream", 4, max_tokens=300, ignore_eos=True)
    costs = []

    def on_step(k, out):
        if any(x.req_id == "stream" for x in out.scheduled):
            costs.append(step_seconds(out))

    done = run(s, {0: group("n", 160, max_tokens=8, prompt_len=prompt_len), 5: [stream]}, on_step)
    assert len(done) == 161
    assert max(costs) <= 2 * (READ_S + ROW_S) + 1e-9


def test_a_short_newcomers_prefill_runs_beside_no_group_row_and_the_group_goes_on():
    s = scheduler()
    stream = make_request("stream", 4, max_tokens=40, ignore_eos=True)
    steps = []

    def on_step(k, out):
        ids = [x.req_id for x in out.scheduled]
        steps.append(("stream" in ids, sum(i != "stream" for i in ids)))

    alone = make_request("alone", 4, max_tokens=30, ignore_eos=True)  # a step of one row is measured
    done = run(s, {0: [alone], 25: group("n", 64, max_tokens=60), 45: [stream]}, on_step)
    assert len(done) == 66
    first = next(i for i, (has_stream, _) in enumerate(steps) if has_stream and i >= 45)
    assert steps[first] == (True, 0)  # the stream's prefill alone
    # then the group's rows beside the stream (but for the bound's one step measuring the stream alone)
    assert sum(group_rows > 0 for _, group_rows in steps[first + 1 : first + 21]) >= 19
