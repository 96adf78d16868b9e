"""Prefills beside running decodes: the pacer's per-stream credit (earned, spent, capped), the chunks it
allows, vLLM's long-prefill threshold and partial-prefill counts, and prompt-logprob tokens counted in
the budget. Steps are timed by a cost model of a CPU (a weight read per step, a cost per token and per
chunk, attention growing with the context), not a clock."""

from __future__ import annotations

import pytest

from infer.config import CacheConfig, SchedulerConfig
from infer.core.prefill_pacer import (
    CREDIT_TOKENS,
    GROUP_ALONE_CHUNK,
    GROUP_CHUNK_FLOOR,
    MIN_PREFILL_TOKENS,
    PRIOR_TOKENS_PER_DECODE,
    NextPrompt,
    PrefillPacer,
)
from infer.core.scheduler import Scheduler
from infer.sampling_params import SamplingParams
from tests.unit.core_fakes import FakeRunner, make_request, step

READ_S, TOKEN_S, CHUNK_S, ATTENTION_S = 0.010, 0.001, 0.020, 2e-7  # per step, token, chunk, token x position


def step_seconds(out) -> float:
    """A CPU-like step: one read of the weights, then per token, per prefill chunk (a small chunk costs
    more per token), plus attention over the context."""
    seconds = READ_S + TOKEN_S * out.num_batched_tokens
    for s in out.scheduled:
        seconds += ATTENTION_S * len(s.token_ids) * (s.start_pos + len(s.token_ids))
        seconds += CHUNK_S if len(s.token_ids) > 1 else 0.0
    return seconds


def scheduler(slowdown: float, budget: int = 2048, **fields) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=16384,
        max_decode_slowdown=slowdown,
        **fields,
    )
    clock = iter(range(1, 10**9))
    return Scheduler(cfg, CacheConfig(num_blocks=2048, block_size=16), clock=lambda: float(next(clock)))


def run(s: Scheduler, arrivals: dict[int, list], max_steps=100_000) -> dict[str, float]:
    """Step to the end with simulated time (the scheduler's clock and the arrival times), adding
    arrivals[k] before step k; returns each request's time from its arrival to its last token."""
    runner, now, arrived, done = FakeRunner(s), [0.0], {}, {}
    s.clock = lambda: now[0]
    for k in range(max_steps):
        for req in arrivals.get(k, []):
            req.arrival_time = arrived[req.req_id] = now[0]
            s.add_request(req)
        if not s.has_unfinished():
            return done
        out, outputs = step(s, runner)
        seconds = step_seconds(out)
        now[0] += seconds
        s.observe_step(out.num_batched_tokens, seconds)
        for o in outputs:
            if o.finished:
                done[o.req_id] = now[0] - arrived[o.req_id]
    raise AssertionError("did not finish")


def bystander_and_long(slowdown: float, long_first: bool, long_prompt: int = 8000, stream_tokens: int = 200):
    """(bystander alone, bystander beside the long prompt, the long prompt's time beside it), the long
    prompt sent one step after the bystander or the other way round."""

    def bystander():
        return make_request("b", 16, max_tokens=stream_tokens, ignore_eos=True)

    def long():
        return make_request("long", long_prompt, max_tokens=1, ignore_eos=True)

    alone = run(scheduler(slowdown), {0: [bystander()]})["b"]
    both = run(
        scheduler(slowdown),
        {0: [long()], 1: [bystander()]} if long_first else {0: [bystander()], 1: [long()]},
    )
    return alone, both["b"], both["long"]


@pytest.mark.parametrize("long_first", [False, True])
def test_without_pacing_a_long_prompt_stalls_the_stream(long_first):
    alone, beside, _ = bystander_and_long(slowdown=0, long_first=long_first)
    assert beside > 3 * alone


@pytest.mark.parametrize("long_first", [False, True])
@pytest.mark.parametrize(
    "long_prompt, stream_tokens",
    [(8000, 200), (8000, 40), (2000, 1000)],  # the prefill at least twice the stream's time, or within it
)
def test_the_stream_keeps_2x_its_time_and_the_prompt_1_5x_its_first_token(
    long_first, long_prompt, stream_tokens
):
    alone, beside, long_time = bystander_and_long(2, long_first, long_prompt, stream_tokens)
    assert beside <= 2 * alone
    _, _, long_unpaced = bystander_and_long(0, long_first, long_prompt, stream_tokens)
    assert long_time <= 1.5 * long_unpaced


def test_where_no_schedule_holds_both_the_stream_keeps_its_bound():
    """A prefill between the stream's time and twice it: whichever finishes first pays the other's
    whole time, and the stream keeps its 2x."""
    alone, beside, long_time = bystander_and_long(2, long_first=False, long_prompt=2000, stream_tokens=200)
    assert beside <= 2 * alone
    _, _, long_unpaced = bystander_and_long(0, long_first=False, long_prompt=2000, stream_tokens=200)
    assert long_time <= 2 * long_unpaced


def pacer_with_decode(decode_s: float = 0.010) -> PrefillPacer:
    pacer = PrefillPacer(max_decode_slowdown=2)
    pacer.observe([make_request("x", 4)], 0, decode_s)  # a decode-only step
    return pacer


def test_a_new_stream_holds_credit_for_its_next_tokens_and_earns_past_them():
    pacer = pacer_with_decode(0.010)
    short = make_request("short", 4, max_tokens=40)
    long = make_request("long", 4, max_tokens=10_000)
    assert pacer.credit_of(short, 0.010) == pytest.approx(40 * 0.010)  # its whole max_tokens ahead
    assert pacer.credit_of(long, 0.010) == pytest.approx(CREDIT_TOKENS * 0.010)  # capped lookahead
    long.pace_credit = 0.0  # spent
    long.output_token_ids.extend([7] * 5)  # five tokens made: five earned past the lookahead
    assert pacer.credit_of(long, 0.010) == pytest.approx(5 * 0.010)
    long.output_token_ids.extend([7] * 1000)  # many more: the credit holds the lookahead's worth at most
    assert pacer.credit_of(long, 0.010) == pytest.approx(CREDIT_TOKENS * 0.010)


def test_a_chunk_is_spent_from_every_decodes_credit_at_most_twice_its_price():
    pacer = PrefillPacer(max_decode_slowdown=2)
    a, b = make_request("a", 4, max_tokens=100), make_request("b", 4, max_tokens=200)
    assert pacer.prefill_limit([a, b], wanted=2048) == 0  # nothing known of a decode step: measure it
    pacer.observe([a, b], 0, 0.010)
    # before a chunk is measured, a token is priced at a decode step / PRIOR_TOKENS_PER_DECODE; the
    # poorer stream (a: its 100 tokens' pace, 1 s, all earned) buys 640 tokens with the margin
    assert pacer.prefill_limit([a, b], wanted=2048) == int(0.8 * 1.0 / (0.010 / PRIOR_TOKENS_PER_DECODE))
    assert pacer.prefill_limit([a, b], wanted=500) == 500  # a chunk it pays for whole
    for _ in range(3):
        pacer.observe([a, b], 500, 0.010 + 0.25)  # 0.5 ms a token
    assert a.pace_credit == pytest.approx(1.0 - 3 * 0.25)
    pacer.observe([a, b], 500, 0.010 + 5.0)  # a stall of the machine: twice the chunk's price, not 5 s
    assert a.pace_credit == pytest.approx(1.0 - 3 * 0.25 - 0.5)
    assert b.pace_credit == pytest.approx(2.0 - 3 * 0.25 - 0.5)


def test_decode_only_steps_when_the_credit_runs_out_and_the_prompt_still_progresses():
    pacer = pacer_with_decode(0.010)
    stream = make_request("s", 4, max_tokens=10_000)
    for _ in range(3):  # chunks of 1000 tokens cost 1 s, four times a stream's capped credit buys
        pacer.observe([stream], 1000, 0.010 + 1.0)
    stream.pace_credit = -1.0  # overspent
    limits = []
    for _ in range(400):
        limit = pacer.prefill_limit([stream], wanted=2000)
        limits.append(limit)
        if limit:
            pacer.observe([stream], limit, 0.010 + 0.001 * limit)
        else:
            pacer.observe([stream], 0, 0.010)
        stream.output_token_ids.append(7)
    assert limits[0] == 0  # owes: a decode-only step earns
    chunks = [n for n in limits if n]
    # the credit caps at CREDIT_TOKENS decodes' worth (2.56 s): a whole 2,000-token chunk, once earned
    assert chunks and all(MIN_PREFILL_TOKENS <= n <= 2000 for n in chunks)
    assert max(chunks) == 2000


def measured_pacer() -> PrefillPacer:
    """A decode-only step of one decode: 10 ms; a prefill unit beside it: 1 ms."""
    pacer = pacer_with_decode(0.010)
    pacer.observe([make_request("x", 4)], 2000, 0.010 + 2.0)
    return pacer


@pytest.mark.parametrize(
    "stream_tokens, prompt_units, waited, stream_came_first, limit",
    [
        (100, 700, 0.0, True, 2000),  # its credit (1 s) pays for the whole prefill: chunks beside it
        (100, 4000, 0.0, True, 0),  # prefill T >= 2 x the stream's time A: the stream first holds both
        (100, 1500, 0.0, True, 0),  # A < T < 2A: one bound only, the stream's
        (100, 1500, 0.0, False, 2000),  # ... unless the stream came after the prompt
        (100, 4000, 2.0, True, 0),  # the prompt already waited: a stream there before it still holds it
        (100, 4000, 2.0, False, 2000),  # a newer one does not, past the prompt's 1.5x
        (10_000, 4000, 0.0, True, 2000),  # its tokens to come pay for the whole prefill: the prompt first
    ],
)
def test_when_the_credit_cannot_pay_the_whole_prefill_one_order_is_chosen(
    stream_tokens, prompt_units, waited, stream_came_first, limit
):
    pacer = measured_pacer()
    stream = make_request("s", 4, max_tokens=stream_tokens, arrival_time=10.0)
    prompt = make_request(
        "p", prompt_units, max_tokens=1, arrival_time=5.0 if not stream_came_first else 20.0
    )
    next_prompt = NextPrompt(prompt, prompt_units, prompt_units, waited)
    assert pacer.prefill_limit([stream], wanted=2000, prompt=next_prompt) == limit


def test_once_the_prompt_goes_first_it_keeps_the_whole_budget_to_its_end():
    pacer = measured_pacer()
    stream = make_request("s", 4, max_tokens=10_000)
    prompt = make_request("p", 8000, max_tokens=1)
    limits = []
    for done in range(0, 8000, 2000):
        limits.append(pacer.prefill_limit([stream], 2000, NextPrompt(prompt, 8000 - done, 8000, 0.0)))
        pacer.observe([stream], 2000, 0.010 + 2.0)  # its credit overspent: the order holds
        stream.output_token_ids.append(7)
    assert limits == [2000] * 4
    other = make_request("q", 8000, max_tokens=1)  # the next prompt: its order is chosen anew
    assert (
        pacer.prefill_limit([make_request("t", 4, max_tokens=100)], 2000, NextPrompt(other, 8000, 8000, 0))
        == 0
    )


def steps_of(s: Scheduler, arrivals: dict[int, list], max_steps=100_000) -> list[dict[str, int]]:
    """Like run: each step's tokens per request."""
    runner, now, steps = FakeRunner(s), [0.0], []
    s.clock = lambda: now[0]
    for k in range(max_steps):
        for req in arrivals.get(k, []):
            req.arrival_time = now[0]
            s.add_request(req)
        if not s.has_unfinished():
            return steps
        out, _ = step(s, runner)
        steps.append({x.req_id: len(x.token_ids) for x in out.scheduled})
        seconds = step_seconds(out)
        now[0] += seconds
        s.observe_step(out.num_batched_tokens, seconds)
    raise AssertionError("did not finish")


def test_in_the_band_the_stream_goes_first_instead_of_sharing_the_steps():
    """A prefill between the stream's time and twice it: after the chunk that measures its price, the
    prompt waits for the stream's end and then takes whole chunks."""
    steps = steps_of(
        scheduler(slowdown=2),
        {
            0: [make_request("b", 16, max_tokens=200, ignore_eos=True)],
            1: [make_request("long", 2000, max_tokens=1)],
        },
    )
    shared = [k for k, st in enumerate(steps) if "b" in st and "long" in st]
    stream_end = max(k for k, st in enumerate(steps) if "b" in st)
    assert len(shared) == 1  # the chunk that measures the price; the credit left is not spent
    assert any("long" in st for st in steps[stream_end + 1 :])


def test_a_short_newcomer_passes_a_prompt_held_behind_the_streams():
    """While the prompt waits for the stream's end, a short request that arrives is prefilled beside the
    stream (the stream's credit pays for it), not held with the prompt."""
    steps = steps_of(
        scheduler(slowdown=2),
        {
            0: [make_request("b", 16, max_tokens=200, ignore_eos=True)],
            1: [make_request("long", 2000, max_tokens=1)],
            20: [make_request("short", 32, max_tokens=4, ignore_eos=True)],
        },
    )
    stream_end = max(k for k, st in enumerate(steps) if "b" in st)
    short_first = min(k for k, st in enumerate(steps) if "short" in st)
    assert short_first <= 22 < stream_end
    assert max(k for k, st in enumerate(steps) if "short" in st) < stream_end
    assert sum(1 for st in steps[:stream_end] if "long" in st) == 1  # still only the measuring chunk


def test_a_long_stream_lets_the_prompt_go_first_with_whole_chunks():
    steps = steps_of(
        scheduler(slowdown=2),
        {
            0: [make_request("b", 16, max_tokens=10_000, ignore_eos=True)],
            1: [make_request("long", 8000, max_tokens=1)],
        },
    )
    chunks = [st["long"] for st in steps if "long" in st]
    assert len(chunks) <= 6 and all(n >= 2000 for n in chunks[1:-1])  # one measures, then whole ones


def test_a_prompt_is_not_held_behind_a_line_of_newer_streams():
    """A stream there before the prompt may hold it (the band); the streams that keep arriving after it
    do not: its prefill ends soon after the first stream's end, not when the arrivals stop."""
    arrivals = {100 * i: [make_request(f"s{i}", 16, max_tokens=150, ignore_eos=True)] for i in range(40)}
    arrivals.setdefault(1, []).append(make_request("long", 3000, max_tokens=1, ignore_eos=True))
    steps = steps_of(scheduler(slowdown=2), arrivals)
    first_stream_end = max(k for k, st in enumerate(steps) if "s0" in st)
    prompt_end = max(k for k, st in enumerate(steps) if "long" in st)
    assert prompt_end <= first_stream_end + 5
    assert len(steps) < 40 * 100 + 200  # every request completes


def test_the_prior_prices_the_first_chunk_from_the_decode_step():
    pacer = pacer_with_decode(0.010)
    assert pacer.seconds_per_unit(2048, 1) == (pytest.approx(0.010 / PRIOR_TOKENS_PER_DECODE), False)
    pacer.observe([make_request("s", 4)], 16, 0.010 + 1.0)  # a cold first step: says nothing of chunks
    assert pacer.seconds_per_unit(2048, 1) == (pytest.approx(0.010 / PRIOR_TOKENS_PER_DECODE), False)
    pacer.observe([make_request("s", 4)], 512, 0.010 + 0.512)
    assert pacer.seconds_per_unit(512, 1) == (pytest.approx(0.001), True)  # measured from then on
    assert pacer.seconds_per_unit(2048, 1) == (pytest.approx(0.001), False)  # the largest chunk's, a guess


def test_a_guessed_price_lets_through_the_chunk_it_buys_to_measure_it():
    pacer = pacer_with_decode(0.010)
    stream = make_request("s", 4, max_tokens=60)  # 0.6 s of credit, all earned: 480 tokens at the prior
    assert pacer.prefill_limit([stream], wanted=2048) == int(0.8 * 0.6 / (0.010 / PRIOR_TOKENS_PER_DECODE))


def test_a_prompt_alone_is_not_paced():
    s = scheduler(slowdown=2)
    s.add_request(make_request("long", 5000, max_tokens=1))
    out, _ = step(s, FakeRunner(s))
    assert out.num_batched_tokens == 2048


def test_a_request_arriving_behind_a_long_prompt_gets_room_in_the_next_step():
    s = scheduler(slowdown=2)
    runner = FakeRunner(s)
    s.add_request(make_request("long", 5000, max_tokens=1))
    step(s, runner)
    s.add_request(make_request("short", list(range(20_000, 20_100)), max_tokens=4))
    out, _ = step(s, runner)
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("short", 100)]


def test_a_short_newcomer_passes_the_long_prompts_queued_before_it_alone():
    """No decodes running, three long prompts waiting behind a running one: a short request arriving
    last is prefilled in the next step, alone (no long chunk in its step)."""
    s = scheduler(slowdown=2)
    runner = FakeRunner(s)
    for i in range(4):
        s.add_request(make_request(f"long{i}", list(range(1000 * i, 1000 * i + 5000)), max_tokens=1))
    step(s, runner)
    s.add_request(make_request("short", list(range(20_000, 20_100)), max_tokens=4))
    out, _ = step(s, runner)
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("short", 100)]


def test_no_step_is_empty_while_requests_run():
    """A group's short requests beside a running long prompt, some past the group's share of the batch:
    whatever pacing holds back (the group's rows, the prompt's chunks), no step is empty, and the prompt
    and every request complete."""
    group = [
        make_request(f"g{i}", list(range(30_000 + 10 * i, 30_010 + 10 * i)), max_tokens=3) for i in range(12)
    ]
    for req in group:
        req.group_id = "g"
    steps = steps_of(scheduler(slowdown=2), {0: [make_request("long", 5000, max_tokens=1)], 1: group})
    assert all(steps) and sum(step.get("long", 0) for step in steps) == 5000


def test_the_group_chunk_costs_a_step_of_the_allowed_slowdown_at_the_measured_price():
    """Beside others, a decode step of 2^-7 s (7.8 ms) and a prefill unit of 2^-17 s (exact in binary, so
    no rounding): a chunk worth half of one decode step (512 units) at max_decode_slowdown 2, 1,536 at 4;
    never under the floor; the floor before any measure. A group alone gets GROUP_ALONE_CHUNK."""
    assert PrefillPacer(max_decode_slowdown=2).group_chunk(1, others=True) == GROUP_CHUNK_FLOOR
    decode = 2.0**-7
    pacer = pacer_with_decode(decode)
    pacer.observe([make_request("x", 4)], 1024, 2 * decode)  # 1,024 units beside it: a decode step more
    assert pacer.group_chunk(1, others=True) == 512
    assert pacer.group_chunk(1, others=False) == GROUP_ALONE_CHUNK
    pacer.slowdown = 4
    assert pacer.group_chunk(1, others=True) == 1536
    pacer.slowdown = 1.001
    assert pacer.group_chunk(1, others=True) == GROUP_CHUNK_FLOOR


def crowded(name: str, n: int, prompt: int, max_tokens: int = 1) -> list:
    reqs = [make_request(f"{name}{i}", list(range(prompt * i, prompt * (i + 1))), max_tokens=max_tokens)
            for i in range(n)]  # fmt: skip
    for req in reqs:
        req.group_id = name
    return reqs


def test_a_crowded_groups_prompts_run_in_small_chunks_and_a_lone_prompt_in_whole_ones():
    """One client's several long prompts (a group) are cut to the pacer's group chunk (alone: 256 tokens
    a step), so that a newcomer waits for a short step; a lone long prompt keeps the whole budget."""
    flood = steps_of(scheduler(slowdown=2), {0: crowded("heavy", 3, 3000)})
    while len(flood[-1]) == 1 and sum(flood[-1].values()) > GROUP_ALONE_CHUNK:
        flood.pop()  # the group's last request, alone: a single again
    # a cut chunk, and at most the last piece of another prompt (a piece under the cut goes in whole)
    assert max(sum(step.values()) for step in flood) <= 2 * GROUP_ALONE_CHUNK
    assert len(flood) > 20
    lone = steps_of(scheduler(slowdown=2), {0: [make_request("long", 5000, max_tokens=1)]})
    assert lone[0] == {"long": 2048}
    off = steps_of(scheduler(slowdown=0), {0: crowded("heavy", 3, 3000)})
    assert max(sum(step.values()) for step in off) == 2048  # unpaced: whole budgets


def test_a_stream_beside_a_crowded_groups_prompts_keeps_its_gaps():
    """A bystander stream beside one client's flood of long prompts: each of its gaps stays within about
    max_decode_slowdown x its decode step (it would wait for 2,048-token chunks otherwise), and every
    request completes."""
    stream = make_request("b", 16, max_tokens=100, ignore_eos=True)
    s = scheduler(slowdown=2)
    steps = steps_of(s, {0: crowded("heavy", 4, 3000), 3: [stream]})
    beside = [step for step in steps if step.get("b") == 1]
    assert len(beside) == 99
    assert max(sum(step.values()) - 1 for step in beside) <= 2 * GROUP_CHUNK_FLOOR  # 2,048 unpaced
    assert {"heavy0", "heavy1", "heavy2", "heavy3"} <= {r for step in steps for r in step}


def test_every_request_completes_beside_several_streams_and_prompts():
    s = scheduler(slowdown=2)
    arrivals = {
        0: [make_request(f"s{i}", 16, max_tokens=60 + 40 * i, ignore_eos=True) for i in range(3)],
        2: [make_request("p1", 6000, max_tokens=2)],
        5: [make_request("p2", 3000, max_tokens=3), make_request("s3", 8, max_tokens=300, ignore_eos=True)],
        40: [make_request("p3", 1000, max_tokens=1)],
    }
    done = run(s, arrivals)
    assert sorted(done) == ["p1", "p2", "p3", "s0", "s1", "s2", "s3"]
    s.check_integrity()


def test_prompt_logprob_tokens_count_in_the_paced_chunk():
    """The pacer allows cost units: a prompt whose logprobs are asked gets that many units' tokens."""
    s = scheduler(slowdown=2)
    s.prompt_logprob_token_cost = 2.0
    runner = FakeRunner(s)
    s.add_request(make_request("b", 16, max_tokens=300, ignore_eos=True))
    for _ in range(3):  # prefill, then decode-only steps the pacer measures
        out, _ = step(s, runner)
        s.observe_step(out.num_batched_tokens, 0.010)
    req = make_request("p", 3000, max_tokens=1)
    req.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    s.add_request(req)
    out, _ = step(s, runner)
    chunk = {x.req_id: len(x.token_ids) for x in out.scheduled}.get("p", 0)
    assert s._last_step[1] == 2 * chunk > 0  # what the pacer is told the step's prefill cost


def test_long_prefill_token_threshold_caps_a_long_prompts_chunk():
    s = scheduler(slowdown=0, long_prefill_token_threshold=256)
    s.add_request(make_request("long", 3000, max_tokens=1))
    s.add_request(make_request("short", 100, max_tokens=1))
    out, _ = step(s, FakeRunner(s))
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("long", 256), ("short", 100)]


@pytest.mark.parametrize("max_partial, admitted", [(1, [("a", 256)]), (2, [("a", 256), ("b", 256)])])
def test_max_num_partial_prefills_bounds_prompts_in_progress(max_partial, admitted):
    s = scheduler(
        slowdown=0,
        budget=512,
        long_prefill_token_threshold=256,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_partial,
    )
    for name in ("a", "b"):
        s.add_request(make_request(name, 1000, max_tokens=1))
    out, _ = step(s, FakeRunner(s))
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == admitted


def test_a_short_prompt_passes_a_long_one_held_by_max_long_partial_prefills():
    s = scheduler(
        slowdown=0,
        long_prefill_token_threshold=512,
        max_num_partial_prefills=4,
        max_long_partial_prefills=1,
    )
    r = FakeRunner(s)
    for name in ("long1", "long2", "short"):
        s.add_request(make_request(name, 3000 if name.startswith("long") else 200, max_tokens=1))
    out, _ = step(s, r)
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("long1", 512), ("short", 200)]
    s.check_integrity()


def test_vllms_default_threshold_with_several_partial_prefills():
    cfg = SchedulerConfig(max_model_len=10_000, max_num_partial_prefills=2)
    assert cfg.long_prefill_token_threshold == 400  # 4% of max_model_len


@pytest.mark.parametrize(
    "fields",
    [
        {"max_decode_slowdown": -1},
        {"long_prefill_token_threshold": -5},
        {"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
    ],
)
def test_bad_values_are_refused(fields):
    with pytest.raises(ValueError):
        SchedulerConfig(**fields)


def test_prompt_logprob_tokens_cost_more_of_the_budget():
    s = scheduler(slowdown=0, budget=1024)
    s.prompt_logprob_token_cost = 2.0
    req = make_request("p", 3000, max_tokens=1)
    req.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    s.add_request(req)
    out, _ = step(s, FakeRunner(s))
    assert [len(x.token_ids) for x in out.scheduled] == [512]
