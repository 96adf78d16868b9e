"""The "slo" policy on hand-built situations, with a step-cost model and a clock the test decides; the
step-cost model's fit; the starvation bound under an adversarial arrival stream."""

from __future__ import annotations

import pytest

from infer.config import CacheConfig, SchedulerConfig
from infer.core.request import Request, RequestStatus
from infer.core.scheduler import MIN_SLO_PREFILL_TOKENS, Scheduler
from infer.core.slo import Objectives, StepCostModel
from infer.sampling_params import SamplingParams
from tests.unit.core_fakes import FakeRunner, plan

COST = dict(a=0.002, b=0.0001)  # a step of N tokens: 2 ms + 0.1 ms per token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slo_scheduler(clock: Clock, policy: str = "slo", budget: int = 256, seqs: int = 8, blocks: int = 256,
                  max_wait: float = 30.0) -> Scheduler:  # fmt: skip
    config = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=budget, policy=policy, max_model_len=4096,
        slo_max_wait_s=max_wait,
    )  # fmt: skip
    cache = CacheConfig(num_blocks=blocks, block_size=16)
    return Scheduler(config, cache, clock=clock, cost_model=StepCostModel(**COST, decay=1.0, min_steps=10**9))


def request(req_id: str, prompt: int, clock: Clock, ttft: float | None = None, tpot: float | None = None,
            max_tokens: int = 8) -> Request:  # fmt: skip
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(10, 10 + prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        arrival_time=clock.now,
        slo=Objectives(ttft, tpot) if ttft or tpot else None,
    )


def step(s: Scheduler, runner: FakeRunner, clock: Clock):
    """One step whose duration is what the cost model says for its tokens, reported as the engine does."""
    out = s.schedule()
    s.check_integrity()
    s.update(out, runner.execute(out))
    s.check_integrity()
    seconds = s.cost_model.seconds(out.num_batched_tokens)
    clock.now += seconds
    s.observe_step(out.num_batched_tokens, seconds)
    return out


def first_token_step(policy: str) -> tuple[int, float]:
    clock = Clock()
    s = slo_scheduler(clock, policy)
    runner = FakeRunner(s)
    s.add_request(request("long", 1000, clock))  # no objective: due 30 s after arrival
    clock.now += 0.001
    short = request("short", 20, clock, ttft=0.05)
    s.add_request(short)
    for n in range(1, 50):
        step(s, runner, clock)
        if short.first_token_time is not None:
            return n, short.first_token_time - short.arrival_time
    raise AssertionError("the short request never got its first token")


def test_a_tight_deadline_short_request_is_not_queued_behind_a_long_prefill():
    fcfs_steps, fcfs_ttft = first_token_step("fcfs")
    slo_steps, slo_ttft = first_token_step("slo")
    assert fcfs_steps == 4 and fcfs_ttft > 0.05  # beside the last of the 1,000-token prompt's 4 chunks
    assert slo_steps == 1 and slo_ttft <= 0.05  # admitted first, by its earlier deadline


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_prefill_beside_a_decode_is_cut_to_its_tpot(policy):
    """A decode with a 20 ms TPOT objective and no slow gap to spare (20 tokens: 4% of 19 gaps is none):
    a step may hold tokens_within(20 ms) = 180 tokens; the waiting prompt gets what is left of them.
    FCFS fills the whole budget."""
    clock = Clock()
    s = slo_scheduler(clock, policy, budget=512)
    runner = FakeRunner(s)
    decoder = request("decoder", 16, clock, tpot=0.02, max_tokens=20)
    s.add_request(decoder)
    step(s, runner, clock)  # its prefill and first token
    s.add_request(request("prompt", 2000, clock))
    out = step(s, runner, clock)
    assert plan(out)[0] == ("decoder", 16, 1, True)
    prefill = out.stats.num_prefill_tokens
    if policy == "fcfs":
        assert prefill == 511
    else:
        assert prefill == s.cost_model.tokens_within(0.02) - 1 == 179
        assert s.cost_model.seconds(out.num_batched_tokens) == pytest.approx(0.02)


def test_every_gap_is_capped_and_a_tpot_too_tight_for_any_prefill_keeps_a_floor():
    """The tightest objective among the decodes bounds the step, whether the request is ahead of its
    rate or not (clients judge the p95 of the gaps); an objective no prefill fits leaves the floor."""
    clock = Clock()
    s = slo_scheduler(clock, budget=2048)
    runner = FakeRunner(s)
    loose = request("loose", 16, clock, tpot=0.05, max_tokens=20)
    tight = request("tight", 16, clock, tpot=0.02, max_tokens=20)
    s.add_request(loose)
    s.add_request(tight)
    for _ in range(3):
        step(s, runner, clock)
    clock.now = tight.first_token_time  # far ahead of its rate: no slack is lent
    s.add_request(request("prompt", 3000, clock))
    out = step(s, runner, clock)
    assert out.num_batched_tokens == s.cost_model.tokens_within(0.02)
    tight.slo = Objectives(tpot_s=0.0021)  # tokens_within(2.1 ms) = 1: not even both decodes fit
    out = step(s, runner, clock)
    assert out.stats.num_prefill_tokens == MIN_SLO_PREFILL_TOKENS


def test_a_decode_spends_its_slow_gaps_before_it_caps_the_prefill():
    """Clients judge the p95 of a request's gaps: 4% of them may be slow. A 101-token request has 4 to
    spend; the steps beside a long prompt run uncapped (and slow) until it has spent them."""
    clock = Clock()
    s = slo_scheduler(clock, budget=512)
    runner = FakeRunner(s)
    decoder = request("decoder", 16, clock, tpot=0.02049, max_tokens=101)
    s.add_request(decoder)
    step(s, runner, clock)
    s.add_request(request("prompt", 4000, clock))
    budgets = [step(s, runner, clock).num_batched_tokens for _ in range(6)]
    assert budgets == [512] * 4 + [s.cost_model.tokens_within(0.02049)] * 2
    assert decoder.num_slow_gaps == 4  # the capped steps were not slow


def test_a_request_that_will_be_late_anyway_goes_after_those_that_can_make_it():
    clock = Clock()
    s = slo_scheduler(clock, seqs=1)
    runner = FakeRunner(s)
    running = request("running", 16, clock, max_tokens=3)
    s.add_request(running)
    step(s, runner, clock)
    late = request("late", 16, clock, ttft=0.01)  # earliest deadline, but it will be missed
    s.add_request(late)
    clock.now += 0.02
    s.add_request(request("ontime", 16, clock, ttft=1.0))
    while running.status == RequestStatus.RUNNING:
        step(s, runner, clock)
    out = step(s, runner, clock)
    assert [p[0] for p in plan(out)] == ["ontime"]
    assert late.status == RequestStatus.WAITING


def test_memory_pressure_preempts_the_latest_deadline():
    clock = Clock()
    s = slo_scheduler(clock, blocks=6, budget=64)  # 6 blocks of 16 tokens
    runner = FakeRunner(s)
    loose = request("loose", 40, clock, ttft=5.0, max_tokens=30)
    tight = request("tight", 40, clock, ttft=0.5, max_tokens=30)
    s.add_request(loose)
    s.add_request(tight)
    while not (loose.num_preemptions or tight.num_preemptions):
        step(s, runner, clock)
    assert loose.num_preemptions == 1 and tight.num_preemptions == 0
    while s.has_unfinished():
        step(s, runner, clock)
    assert loose.finish_reason == tight.finish_reason == "length"


def test_no_request_waits_past_the_bound_under_an_endless_stream_of_tighter_ones():
    """One seat, and every step a new request arrives whose deadline beats X's: X is admitted once it
    has waited slo_max_wait_s, within the current occupant's remaining service, not never."""
    clock = Clock()
    max_wait = 0.5
    s = slo_scheduler(clock, seqs=1, max_wait=max_wait, budget=64)
    runner = FakeRunner(s)
    x = request("x", 32, clock, max_tokens=2)  # no objective
    s.add_request(x)
    for n in range(2000):
        s.add_request(request(f"u{n}", 32, clock, ttft=0.05, max_tokens=4))
        step(s, runner, clock)
        if x.first_scheduled_time is not None:
            break
    waited = x.first_scheduled_time - x.arrival_time
    longest_service = 4 * s.cost_model.seconds(64)  # one occupant: its prefill and 3 decodes at most
    assert max_wait <= waited <= max_wait + longest_service


def test_the_cost_model_fits_the_steps_it_sees_and_follows_a_drift():
    model = StepCostModel(a=0.01, b=0.001)  # a wrong prior
    for n in (1, 8, 32, 128, 512, 300, 17) * 20:
        model.observe(n, 0.003 + 0.00008 * n)
    assert model.a == pytest.approx(0.003, rel=0.05) and model.b == pytest.approx(0.00008, rel=0.05)
    assert model.tokens_within(0.003 + 0.00008 * 100) in (99, 100)
    for n in (1, 8, 32, 128, 512) * 100:  # the machine got twice as slow
        model.observe(n, 2 * (0.003 + 0.00008 * n))
    assert model.b == pytest.approx(0.00016, rel=0.1)
    model.observe(0, 1.0)  # nothing learnt from an empty or an impossible step
    model.observe(10, float("nan"))
    assert model.b == pytest.approx(0.00016, rel=0.1)
    fresh = StepCostModel(a=0.01, b=0.001, min_steps=8)
    for _ in range(7):
        fresh.observe(64, 0.5)
    assert (fresh.a, fresh.b) == (0.01, 0.001)  # the prior, until 8 steps
    fresh.observe(64, 0.5)
    assert fresh.b == 0.001 and fresh.a == pytest.approx(0.5 - 0.064)  # one size only: the level


def test_objectives_are_validated():
    assert Objectives(ttft_s=0.5).tpot_s is None
    for bad in (0, -1, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="ttft_s"):
            Objectives(ttft_s=bad)
    with pytest.raises(ValueError, match="slo_max_wait_s"):
        SchedulerConfig(policy="slo", slo_max_wait_s=0)
