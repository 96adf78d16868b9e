"""A seeded random workload: arrivals, shared prefixes, priorities, aborts (also mid-step), EOS, a pool
small enough to force preemption and eviction. Integrity is checked after every schedule and update;
the fake runner checks that the KV every step relies on holds the right tokens; at the end every block
is back in the pool and every request finished with a reason, and every request that was not aborted
produced exactly the tokens it would have produced alone."""

import random

import pytest

from infer.core.request import RequestStatus
from infer.core.slo import Objectives
from tests.unit.core_fakes import EOS, FakeRunner, default_token, make_request, make_scheduler, plan

CONFIGS = {
    "fcfs-chunk5": dict(prefill_chunk_size=5),
    "priority-chunked": dict(policy="priority"),
    "fcfs-whole-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=32),
    "priority-nocache-chunk3": dict(policy="priority", enable_prefix_caching=False, prefill_chunk_size=3),
    "contiguous-priority": dict(kv_cache_backend="contiguous", num_blocks=24, policy="priority"),
    "static-fcfs": dict(batching_mode="static"),
    "priority-wide": dict(policy="priority", max_num_seqs=8, num_blocks=20, prefill_chunk_size=7),
    "slo-chunk5": dict(policy="slo", prefill_chunk_size=5),
}
BASE = dict(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)


def eos_token(seed: int):
    def next_token(req_id: str, i: int) -> int:
        return EOS if random.Random(f"{seed}/{req_id}/{i}").random() < 0.08 else default_token(req_id, i)

    return next_token


def expected_output(next_token, req_id: str, max_tokens: int) -> tuple[list[int], str]:
    out = []
    for i in range(max_tokens):
        out.append(next_token(req_id, i))
        if out[-1] == EOS:
            return out, "stop"
    return out, "length"


def run_workload(seed: int, config: dict, num_requests: int = 120, priorities: bool = True):
    rng = random.Random(seed)
    s = make_scheduler(**{**BASE, **config})
    next_token = eos_token(seed)
    runner = FakeRunner(s, next_token)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    arrivals, t = [], 0
    for i in range(num_requests):
        t += rng.choice([0, 0, 1, 2, 3])
        prefix = rng.choice(prefixes + [[]])
        prompt = prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 10))]
        priority = rng.randint(0, 2) if priorities else 0
        req = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 10), priority=priority, arrival_time=t)
        if rng.random() < 0.7:  # objectives, for "slo" (the others ignore them)
            req.slo = Objectives(ttft_s=rng.choice([0.5, 5.0, 50.0]), tpot_s=rng.choice([None, 0.5, 3.0]))
        arrivals.append(req)
    pending, aborted, trace = list(arrivals), set(), []
    for step_index in range(5000):
        while pending and pending[0].arrival_time <= step_index:
            s.add_request(pending.pop(0))
        if not pending and not s.has_unfinished():
            break
        if s.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        running_before = [r.req_id for r in s.running]
        out = s.schedule()
        s.check_integrity()
        # Victims are always the worst-keyed running requests: a suffix of the running queue.
        num_preempted = len(out.preempted_req_ids)
        assert sorted(out.preempted_req_ids) == sorted(running_before[len(running_before) - num_preempted :])
        runner_out = runner.execute(out)
        if out.scheduled and rng.random() < 0.02:  # a client disconnects while the step runs
            victim = rng.choice(out.scheduled).req_id
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        s.update(out, runner_out)
        s.check_integrity()
        trace.append((plan(out), out.preempted_req_ids, out.finished_req_ids))
    else:
        raise AssertionError("the workload did not finish: a stuck queue")
    return s, arrivals, aborted, trace, next_token


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload(name, seed):
    s, reqs, aborted, trace, next_token = run_workload(seed, CONFIGS[name])
    kv = s.kv_cache_manager
    assert not s.has_unfinished() and s.num_running == s.num_waiting == 0
    assert kv.num_used_blocks == 0 and kv.usage == 0.0
    if hasattr(kv, "pool"):
        assert len(kv.pool.free_queue) == kv.num_blocks
    kv.check_integrity()
    for req in reqs:
        assert req.is_finished() and req.finished_time is not None, req.req_id
        if req.req_id in aborted:
            assert req.finish_reason == "abort"
            continue
        expected, reason = expected_output(next_token, req.req_id, req.sampling_params.max_tokens)
        assert (req.output_token_ids, req.finish_reason) == (expected, reason), req.req_id
    finished_ids = [rid for _, _, finished in trace for rid in finished] + sorted(s._finished_req_ids)
    assert sorted(finished_ids) == sorted(r.req_id for r in reqs)  # each reported exactly once
    # The workload must exercise what it claims to test.
    assert len(aborted) > 0
    if name != "contiguous-priority":
        assert s.num_preemptions > 0
    if kv.enable_caching:
        assert kv.num_hits > 0 and kv.num_evictions > 0


@pytest.mark.parametrize("seed", [3, 4])
def test_equal_priorities_make_priority_exactly_fcfs(seed):
    _, _, _, fcfs, _ = run_workload(seed, {}, priorities=False)
    s, _, _, prio, _ = run_workload(seed, {"policy": "priority"}, priorities=False)
    assert s.num_preemptions > 0
    assert prio == fcfs
