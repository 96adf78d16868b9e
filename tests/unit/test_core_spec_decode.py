"""Speculative decoding in the scheduler and the KV cache manager, driven by a fake model.

The fake model's next token is a function of the request and the output index, so its outputs do not
depend on how they were computed; a proposer guesses (some right, some wrong), and the fake runner
verifies the guesses greedily as the real one does. The fake KV cache checks before every step that each
computed position holds the request's own token: a rejected proposal's KV read as computed would fail it.
"""

from __future__ import annotations

import random

import pytest

from infer.core.block_hash import hash_blocks
from infer.core.outputs import ModelRunnerOutput, SchedulerOutput
from infer.core.request import RequestStatus
from tests.unit.core_fakes import EOS, default_token, make_request, make_scheduler
from tests.unit.test_core_scheduler_random import BASE, eos_token, expected_output
from tests.unit.test_core_scheduler_random import CONFIGS as RANDOM_CONFIGS


class SpecFakeRunner:
    """Verifies proposals against `next_token`: row j's token is the one after j proposals."""

    def __init__(self, scheduler, next_token=default_token):
        self.scheduler = scheduler
        self.block_size = scheduler.cache_config.block_size
        self.next_token = next_token
        self.slots: dict[int, int] = {}

    def _slot(self, block_ids, pos):
        assert pos // self.block_size < len(block_ids), (pos, block_ids)
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput([], [])
        for s in out.scheduled:
            req = self.scheduler.requests[s.req_id]
            known = s.token_ids[: len(s.token_ids) - len(s.spec_token_ids)]
            assert known == req.token_ids[s.start_pos : s.start_pos + len(known)]
            for pos in range(s.start_pos):
                got = self.slots.get(self._slot(s.block_ids, pos))
                assert got == req.token_ids[pos], f"{s.req_id} pos {pos}: cache holds {got}"
            for i, token in enumerate(s.token_ids):
                self.slots[self._slot(s.block_ids, s.start_pos + i)] = token
            if not s.sample:
                continue
            accepted = []
            for j, token in enumerate(s.spec_token_ids):
                if token != self.next_token(s.req_id, req.num_output_tokens + j):
                    break
                accepted.append(token)
            result.req_ids.append(s.req_id)
            result.sampled_token_ids.append(self.next_token(s.req_id, req.num_output_tokens + len(accepted)))
            if s.spec_token_ids:
                result.accepted_token_ids[s.req_id] = accepted
        return result


def guesser(rng: random.Random, k: int, hit_rate: float):
    """Proposals for a request: each right (the fake model's next token) with probability hit_rate."""

    def propose(req):
        out = []
        for j in range(k):
            right = default_token(req.req_id, req.num_output_tokens + j)
            out.append(right if rng.random() < hit_rate else right + 1)
        return out

    return propose


def run(scheduler, runner, propose=None, max_steps=2000):
    """Step to completion (proposing before each step when given a proposer); outputs per request."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        if propose is not None:
            for req in scheduler.running:
                req.spec_token_ids = [] if req.is_prefill else propose(req)
        out = scheduler.schedule()
        scheduler.check_integrity()
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for o in scheduler.update(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        scheduler.check_integrity()
    raise AssertionError("not finished")


def test_a_decode_with_k_proposals_costs_1_plus_k_tokens():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = SpecFakeRunner(sched)
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    sched.update(out := sched.schedule(), runner.execute(out))  # the prompt, and the first token
    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [req.token_ids[-1], 1, 2, 3] and s.spec_token_ids == [1, 2, 3]
    assert s.start_pos == 5 and s.sample
    assert out.num_batched_tokens == 4 and out.stats.num_decode_tokens == 4 and out.stats.num_spec_tokens == 3
    assert req.spec_token_ids == []  # consumed
    sched.check_integrity()  # the proposals in flight count as known tokens
    outputs = sched.update(out, runner.execute(out))
    assert outputs[0].new_token_ids == [default_token("a", 1)]  # all three rejected
    assert req.num_computed_tokens == req.num_tokens - 1 == 6
    assert sched.num_spec_draft_tokens == 3 and sched.num_spec_accepted_tokens == 0
    sched.check_integrity()


def test_accepted_proposals_are_emitted_with_the_token_after_them():
    sched = make_scheduler()
    runner = SpecFakeRunner(sched)
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    sched.update(out := sched.schedule(), runner.execute(out))
    right = [default_token("a", i) for i in range(1, 4)]
    req.spec_token_ids = [right[0], right[1], 999]
    out = sched.schedule()
    (o,) = sched.update(out, runner.execute(out))
    assert o.new_token_ids == right  # two accepted, then the model's own third
    assert req.output_token_ids == [default_token("a", 0), *right]
    assert req.num_computed_tokens == req.num_tokens - 1
    assert sched.num_spec_accepted_tokens == 2 and sched.num_spec_accepted_per_pos == [1, 1]


def test_proposals_never_run_past_max_tokens_or_a_stop_token():
    sched = make_scheduler()
    runner = SpecFakeRunner(sched)
    req = make_request("a", 5, max_tokens=3)
    sched.add_request(req)
    sched.update(out := sched.schedule(), runner.execute(out))
    req.spec_token_ids = [default_token("a", i) for i in range(1, 6)]
    out = sched.schedule()
    assert len(out.scheduled[0].spec_token_ids) == 1  # 1 output so far, 2 to go: 1 proposal + 1 sampled
    (o,) = sched.update(out, runner.execute(out))
    assert o.finished and o.finish_reason == "length" and req.num_output_tokens == 3

    sched = make_scheduler()
    tokens = {0: 50, 1: 51, 2: EOS, 3: 53, 4: 54}
    runner = SpecFakeRunner(sched, next_token=lambda req_id, i: tokens[i])
    req = make_request("b", 5, max_tokens=10)
    sched.add_request(req)
    sched.update(out := sched.schedule(), runner.execute(out))
    req.spec_token_ids = [51, EOS, 53]  # all three right: EOS ends it, 53 is never emitted
    out = sched.schedule()
    (o,) = sched.update(out, runner.execute(out))
    assert (
        o.new_token_ids == [51, EOS] and o.finish_reason == "stop" and req.output_token_ids == [50, 51, EOS]
    )
    assert sched.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("hit_rate", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_are_the_same_with_and_without_proposals(hit_rate, caching):
    """Many requests sharing prefixes, a pool small enough to preempt, chunked prefill: the outputs and
    the fake KV cache's contents are those of plain decoding whatever the proposals."""
    rng = random.Random(hit_rate)
    prompts = [
        [7, 8, 9, 10, 11, 12] + [rng.randrange(20, 40) for _ in range(rng.randrange(1, 12))] for _ in range(8)
    ]
    max_tokens = [rng.randrange(6, 16) for _ in prompts]

    def outputs(propose):
        sched = make_scheduler(
            num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
            prefill_chunk_size=5, enable_prefix_caching=caching,
        )  # fmt: skip
        for i, prompt in enumerate(prompts):
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens[i]))
        got = run(sched, SpecFakeRunner(sched), propose)
        assert sched.kv_cache_manager.num_used_blocks == 0
        return got, sched

    plain, _ = outputs(None)
    speculated, sched = outputs(guesser(random.Random(1), k=3, hit_rate=hit_rate))
    assert speculated == plain
    assert sched.num_spec_draft_tokens > 0
    if hit_rate == 1.0:
        assert sched.num_spec_accepted_tokens > 0
    if hit_rate == 0.0:
        assert sched.num_spec_accepted_tokens == 0
    assert sched.num_preemptions > 0  # the pool was short: preemption met speculation


def test_rejected_proposals_are_never_cached():
    """Proposals that fill a block and are rejected leave no hash behind: a prompt of the sequence with
    those proposals gets no hit on that block."""
    sched = make_scheduler(block_size=4)
    runner = SpecFakeRunner(sched)
    req = make_request("a", 3, max_tokens=10)  # prompt 10 11 12
    sched.add_request(req)
    sched.update(out := sched.schedule(), runner.execute(out))  # first token: 4 tokens, block 0 full
    wrong = [900, 901, 902, 903]  # positions 4..7 (block 1 whole): all rejected
    req.spec_token_ids = wrong
    sched.update(out := sched.schedule(), runner.execute(out))
    pool = sched.kv_cache_manager.pool
    guessed = [*req.token_ids[:4], *wrong]
    assert req.token_ids[:4] == guessed[:4]
    hashes = hash_blocks(guessed, 4, [], 2)
    assert pool.get_cached_block(hashes[0]) is not None  # the verified block is cached
    assert pool.get_cached_block(hashes[1]) is None
    other = make_request("b", [*guessed, 5])
    blocks, num_hit = sched.kv_cache_manager.get_computed_blocks(other)
    assert num_hit == 4


def test_aborting_mid_speculation_leaves_the_pool_whole():
    sched = make_scheduler(num_blocks=16, block_size=4)
    runner = SpecFakeRunner(sched)
    kv = sched.kv_cache_manager
    free_at_start = kv.num_free_blocks + kv.num_cached_blocks
    propose = guesser(random.Random(0), k=4, hit_rate=0.5)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 6, max_tokens=30))
    for _ in range(4):
        for req in sched.running:
            req.spec_token_ids = [] if req.is_prefill else propose(req)
        sched.update(out := sched.schedule(), runner.execute(out))
        sched.check_integrity()
    for req in sched.running:
        req.spec_token_ids = propose(req)
    sched.finish_requests(["r0", "r1", "r2"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks + kv.num_cached_blocks == free_at_start
    assert not sched.has_unfinished()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_random_workload_with_proposals(name, seed):
    """test_core_scheduler_random's workload (arrivals, shared prefixes, priorities, EOS, aborts also
    mid-step, preemption and eviction) with proposals, right or wrong, before every step: every request
    not aborted produces exactly its tokens alone, and every block comes back."""
    rng = random.Random(seed)
    s = make_scheduler(**{**BASE, **RANDOM_CONFIGS[name]})
    next_token = eos_token(seed)
    runner = SpecFakeRunner(s, next_token)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    pending, t = [], 0
    for i in range(80):
        t += rng.choice([0, 0, 1, 2, 3])
        prompt = rng.choice(prefixes + [[]]) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 10))]
        pending.append(
            make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 10), priority=rng.randint(0, 2))
        )
        pending[-1].arrival_time = t
    reqs, aborted = list(pending), set()
    for step_index in range(5000):
        while pending and pending[0].arrival_time <= step_index:
            s.add_request(pending.pop(0))
        if not pending and not s.has_unfinished():
            break
        for req in s.running:
            k = 0 if req.is_prefill else rng.randint(0, 4)
            right = [next_token(req.req_id, req.num_output_tokens + j) for j in range(k)]
            req.spec_token_ids = [tok if rng.random() < 0.7 else tok + 1 for tok in right]
        if s.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        out = s.schedule()
        s.check_integrity()
        runner_out = runner.execute(out)
        if out.scheduled and rng.random() < 0.03:  # a client disconnects while the step runs
            victim = rng.choice(out.scheduled).req_id
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        s.update(out, runner_out)
        s.check_integrity()
    else:
        raise AssertionError("the workload did not finish")
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0
    for req in reqs:
        assert req.is_finished(), req.req_id
        if req.req_id not in aborted:
            expected = expected_output(next_token, req.req_id, req.sampling_params.max_tokens)
            assert (req.output_token_ids, req.finish_reason) == expected, req.req_id
    assert s.num_spec_accepted_tokens > 0 and s.num_spec_draft_tokens > s.num_spec_accepted_tokens
    assert aborted
