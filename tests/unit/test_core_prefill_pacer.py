"""Prefills beside running decodes: the pacer's step-time bound, vLLM's long-prefill threshold and
partial-prefill counts, and prompt-logprob tokens counted in the budget. Steps are timed by a cost model
of a CPU (a weight read per step, a cost per token, attention growing with the context), not a clock."""

from __future__ import annotations

import pytest

from infer.config import CacheConfig, SchedulerConfig
from infer.core.prefill_pacer import INITIAL_PREFILL_TOKENS, MIN_PREFILL_TOKENS, PrefillPacer
from infer.core.scheduler import Scheduler
from infer.sampling_params import SamplingParams
from tests.unit.core_fakes import FakeRunner, make_request, step

READ_S, TOKEN_S, ATTENTION_S = 0.010, 0.001, 2e-7  # per step, per token, per token x context position


def step_seconds(out) -> float:
    """A CPU-like step: one read of the weights, then per token, plus attention over the context."""
    seconds = READ_S + TOKEN_S * out.num_batched_tokens
    for s in out.scheduled:
        seconds += ATTENTION_S * len(s.token_ids) * (s.start_pos + len(s.token_ids))
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
    """Step to the end with simulated time, adding arrivals[k] before step k; returns each request's
    time from its arrival to its last token."""
    runner, now, arrived, done = FakeRunner(s), 0.0, {}, {}
    for k in range(max_steps):
        for req in arrivals.get(k, []):
            s.add_request(req)
            arrived[req.req_id] = now
        if not s.has_unfinished():
            return done
        out, outputs = step(s, runner)
        seconds = step_seconds(out)
        now += seconds
        s.observe_step(out.num_batched_tokens, seconds)
        for o in outputs:
            if o.finished:
                done[o.req_id] = now - arrived[o.req_id]
    raise AssertionError("did not finish")


def bystander_and_long(slowdown: float, long_first: bool, long_prompt: int = 8000):
    """(bystander alone, bystander beside the long prompt, the long prompt's time beside it), the long
    prompt sent one step after the bystander or the other way round."""

    def bystander():
        return make_request("b", 16, max_tokens=200, ignore_eos=True)

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
def test_pacing_keeps_the_stream_within_its_bound_and_the_long_prompt_progresses(long_first):
    alone, beside, long_time = bystander_and_long(slowdown=2, long_first=long_first)
    assert beside <= 2.2 * alone  # the bound, with the steps the pacer spends learning
    _, _, long_unpaced = bystander_and_long(slowdown=0, long_first=long_first)
    assert long_time <= 1.5 * long_unpaced


@pytest.mark.parametrize("long_prompt", [2000, 8000, 16000])
def test_no_step_beside_a_decode_takes_much_over_the_bound(long_prompt):
    """Each gap of a stream, not only their mean: once the pacer has seen a few paced steps, a step that
    carries decodes and prefill takes at most about max_decode_slowdown times a decode-only one."""
    s = scheduler(slowdown=2)
    runner = FakeRunner(s)
    s.add_request(make_request("b", 16, max_tokens=400, ignore_eos=True))
    decode_only, paced = [], []
    for k in range(100_000):
        if k == 3:
            s.add_request(make_request("long", long_prompt, max_tokens=1, ignore_eos=True))
        if not s.has_unfinished():
            break
        out, _ = step(s, runner)
        seconds = step_seconds(out)
        s.observe_step(out.num_batched_tokens, seconds)
        num_decode, num_prefill = out.stats.num_decode_tokens, out.stats.num_prefill_tokens
        if num_decode:
            (paced if num_prefill else decode_only).append(seconds)
    assert len(paced) > 10
    assert max(paced[4:]) <= 2.2 * max(decode_only)


def test_stalls_of_a_busy_machine_do_not_shrink_the_chunks():
    """A step that a stall of the machine made slow says little of what a prefill token costs: the
    allowance follows the median of recent steps, and a stall costs two decode-only steps at most."""
    pacer = PrefillPacer(max_decode_slowdown=2, max_tokens=2048)
    pacer.observe(num_decodes=1, num_prefill=0, seconds=0.010)
    for _ in range(20):  # 0.1 ms a token: 100 tokens fill the 10 ms a paced step may add
        limit = pacer.prefill_limit(num_decodes=1)
        pacer.observe(num_decodes=1, num_prefill=limit, seconds=(0.010 + 0.0001 * limit) if limit else 0.010)
    assert pacer.allowed == 100
    allowed, num_paced, decode_only = [], 0, 0
    for _ in range(60):  # every fourth paced step stalls for 50 ms
        limit = pacer.prefill_limit(num_decodes=1)
        stall = 0.050 if limit and num_paced % 4 == 0 else 0.0
        pacer.observe(num_decodes=1, num_prefill=limit, seconds=0.010 + 0.0001 * limit + stall)
        allowed.append(pacer.allowed)
        num_paced += limit > 0
        decode_only += limit == 0
    assert min(allowed) == 100
    assert decode_only <= 2 * num_paced / 4  # two for each stall at most


def test_below_a_cpus_compute_knee_small_chunks_do_not_grow_the_allowance_past_it():
    """A step reads the weights once: up to the knee a prefill token costs ~nothing, past it each costs
    its compute. Small chunks' near-zero costs must not send the allowance past the bound."""
    pacer = PrefillPacer(max_decode_slowdown=2, max_tokens=2048)

    def seconds(num_prefill: int) -> float:
        return max(0.025, 0.0002 * (1 + num_prefill)) + 0.0025

    pacer.observe(num_decodes=1, num_prefill=0, seconds=seconds(0))
    paced = []
    for _ in range(80):
        limit = pacer.prefill_limit(num_decodes=1)
        pacer.observe(num_decodes=1, num_prefill=limit, seconds=seconds(limit))
        if limit:
            paced.append(seconds(limit))
    assert max(paced[6:]) <= 2.2 * seconds(0)
    assert pacer.allowed >= 200  # and the chunks grew to about what the bound holds (262 tokens)


def test_a_prompt_alone_is_not_paced():
    s = scheduler(slowdown=2)
    s.add_request(make_request("long", 5000, max_tokens=1))
    out, _ = step(s, FakeRunner(s))
    assert out.num_batched_tokens == 2048


def test_the_pacer_probes_decode_only_steps_and_backs_off_slow_steps():
    pacer = PrefillPacer(max_decode_slowdown=2, max_tokens=2048)
    assert pacer.prefill_limit(num_decodes=0) is None
    assert pacer.prefill_limit(num_decodes=1) == 0  # nothing known of a decode alone: learn it first
    pacer.observe(num_decodes=1, num_prefill=0, seconds=0.010)
    start = INITIAL_PREFILL_TOKENS
    assert pacer.prefill_limit(num_decodes=1) == start  # a small start, learned up
    pacer.observe(num_decodes=1, num_prefill=start, seconds=0.012)  # well within 2x a decode
    assert pacer.allowed == 2 * start  # doubled at most per step
    pacer.observe(num_decodes=1, num_prefill=2 * start, seconds=0.200)  # 20x a decode: over the bound
    assert pacer.allowed == start  # halved at most per step
    # over 2x: what decode-only steps pay back, 0.010 each; two of them at most for one step (a stall of
    # the machine is not the prefill's doing)
    assert pacer.debt == pytest.approx(2 * 0.010)
    assert [pacer.prefill_limit(num_decodes=1) for _ in range(1)] == [0]
    for _ in range(2):
        pacer.observe(num_decodes=1, num_prefill=0, seconds=0.010)
    assert pacer.debt < 1e-6 and pacer.prefill_limit(num_decodes=1) == start


def test_an_outlier_decode_step_does_not_set_the_target():
    pacer = PrefillPacer(max_decode_slowdown=2, max_tokens=2048)
    for seconds in (0.5, 0.010, 0.011, 0.010):  # the first one slow (a warm-up, a busy machine)
        pacer.observe(num_decodes=1, num_prefill=0, seconds=seconds)
    assert pacer.decode_seconds(1) == pytest.approx(0.0105)


def test_where_even_the_smallest_chunk_overshoots_prefill_and_decode_steps_alternate():
    pacer = PrefillPacer(max_decode_slowdown=2, max_tokens=2048)
    pacer.observe(num_decodes=1, num_prefill=0, seconds=0.010)
    kinds = []
    for _ in range(200):
        limit = pacer.prefill_limit(num_decodes=1)
        # an eager step costs 40 ms whatever its size, against 10 ms for a decode-only step
        seconds = 0.040 + 0.0001 * limit if limit else 0.010
        pacer.observe(num_decodes=1, num_prefill=limit, seconds=seconds)
        kinds.append((limit > 0, seconds))
    assert pacer.allowed == MIN_PREFILL_TOKENS
    total = sum(s for _, s in kinds)
    assert total <= 2.1 * 0.010 * len(kinds)  # on average within the bound
    assert sum(p for p, _ in kinds) >= 0.2 * len(kinds)  # and the prompt still progresses


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
