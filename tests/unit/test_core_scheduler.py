import pytest

from infer.core.request import RequestStatus
from tests.unit.core_fakes import (
    EOS,
    FakeRunner,
    default_token,
    make_request,
    make_scheduler,
    plan,
    run_to_completion,
    step,
)


def test_budget_split_and_decode_first():
    s = make_scheduler(max_num_batched_tokens=8)
    r = FakeRunner(s)
    for name in "abc":
        s.add_request(make_request(name, 3, max_tokens=10))
    out, _ = step(s, r)
    assert plan(out) == [("a", 0, 3, True), ("b", 0, 3, True), ("c", 0, 2, False)]
    assert (out.num_batched_tokens, out.stats.num_prefill_tokens, out.stats.num_decode_tokens) == (8, 8, 0)
    s.add_request(make_request("d", 20, max_tokens=2))
    out, _ = step(s, r)
    # decodes of a and b, then c's last prefill token, then d's first chunk with what is left (5).
    assert plan(out) == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 2, 1, True), ("d", 0, 5, False)]
    assert (out.stats.num_decode_tokens, out.stats.num_prefill_tokens) == (2, 6)
    assert (out.stats.num_running, out.stats.num_waiting, out.stats.num_blocks_used) == (4, 0, 5)
    out, _ = step(s, r)
    assert plan(out) == [("a", 4, 1, True), ("b", 4, 1, True), ("c", 3, 1, True), ("d", 5, 5, False)]


def test_decodes_go_before_an_earlier_request_prefill_chunk():
    s = make_scheduler(max_num_batched_tokens=8, prefill_chunk_size=4)
    r = FakeRunner(s)
    s.add_request(make_request("long", 20))
    s.add_request(make_request("short", 2))
    assert plan(step(s, r)[0]) == [("long", 0, 4, False), ("short", 0, 2, True)]
    assert plan(step(s, r)[0]) == [("short", 2, 1, True), ("long", 4, 4, False)]


def test_odd_chunk_boundaries():
    s = make_scheduler(max_num_batched_tokens=16, prefill_chunk_size=3)
    r = FakeRunner(s)
    s.add_request(make_request("a", 10, max_tokens=2))
    plans = [plan(out) for out in run_to_completion(s, r)]
    assert plans == [
        [("a", 0, 3, False)],
        [("a", 3, 3, False)],
        [("a", 6, 3, False)],
        [("a", 9, 1, True)],
        [("a", 10, 1, True)],
    ]
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=5, prefill_chunk_size=3)
    r = FakeRunner(s)
    s.add_request(make_request("a", 7, max_tokens=2))
    s.add_request(make_request("b", 5, max_tokens=2))
    plans = [plan(out) for out in run_to_completion(s, r)]
    assert plans == [
        [("a", 0, 3, False), ("b", 0, 2, False)],
        [("a", 3, 3, False), ("b", 2, 2, False)],
        [("a", 6, 1, True), ("b", 4, 1, True)],
        [("a", 7, 1, True), ("b", 5, 1, True)],
    ]


def test_chunked_prefill_off_prefills_whole_prompts():
    s = make_scheduler(max_num_batched_tokens=12, enable_chunked_prefill=False, prefill_chunk_size=4)
    r = FakeRunner(s)
    for name, n in [("a", 5), ("b", 6), ("c", 4)]:
        s.add_request(make_request(name, n, max_tokens=2))
    assert plan(step(s, r)[0]) == [("a", 0, 5, True), ("b", 0, 6, True)]  # c (4) > 1 left: waits
    assert plan(step(s, r)[0]) == [("a", 5, 1, True), ("b", 6, 1, True), ("c", 0, 4, True)]
    with pytest.raises(ValueError, match=r"chunked prefill off, up to 13 tokens .* \(12\)"):
        s.add_request(make_request("x", 10, max_tokens=4))


def test_priority_admission_order():
    for policy, first in [("priority", "high"), ("fcfs", "low")]:
        s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8, policy=policy)
        s.add_request(make_request("low", 3, priority=5))
        s.add_request(make_request("high", 3, priority=0))
        assert plan(step(s, FakeRunner(s))[0]) == [(first, 0, 3, True)]


@pytest.mark.parametrize("caching", [False, True])
def test_priority_preemption_and_resumption(caching):
    s = make_scheduler(
        max_num_seqs=1, max_num_batched_tokens=8, policy="priority", enable_prefix_caching=caching
    )
    r = FakeRunner(s)
    low = make_request("low", 3, max_tokens=4, priority=5)
    s.add_request(low)
    step(s, r), step(s, r)  # prefill, one decode: low has 2 outputs, 4 computed tokens
    high = make_request("high", 3, max_tokens=2, priority=0)
    s.add_request(high)
    out, _ = step(s, r)
    assert plan(out) == [("high", 0, 3, True)] and out.preempted_req_ids == ["low"]
    assert (low.status, low.num_preemptions, low.num_computed_tokens) == (RequestStatus.PREEMPTED, 1, 0)
    assert s.waiting == [low] and out.stats.num_preemptions == 1
    out, _ = step(s, r)
    assert plan(out) == [("high", 3, 1, True)] and high.finish_reason == "length"
    out, _ = step(s, r)  # low resumes: prompt + its 2 generated tokens are recomputed (or hit the cache)
    expected = ("low", 0, 5, True) if not caching else ("low", 4, 1, True)
    assert plan(out) == [expected] and out.finished_req_ids == ["high"]
    assert out.scheduled[0].token_ids == (low.prompt_token_ids + low.output_token_ids[:2])[expected[1] :]
    run_to_completion(s, r)
    assert low.output_token_ids == [default_token("low", i) for i in range(4)]
    assert low.finish_reason == "length" and low.num_cached_tokens == 0


def test_decode_block_shortage_preempts_latest_arrival_and_resumes():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    r = FakeRunner(s)
    a, b = make_request("a", 6, max_tokens=8), make_request("b", 6, max_tokens=8)
    s.add_request(a), s.add_request(b)
    trace = run_to_completion(s, r)
    assert len(trace) == 13 and s.num_preemptions == 1
    assert plan(trace[0]) == [("a", 0, 6, True), ("b", 0, 6, True)]
    assert plan(trace[3]) == [("a", 8, 1, True)] and trace[3].preempted_req_ids == ["b"]
    assert trace[3].scheduled[0].block_ids == [0, 1, 3]  # b's tail block went first
    assert [plan(t) for t in trace[4:8]] == [[("a", p, 1, True)] for p in range(9, 13)]  # b cannot fit
    assert trace[7].scheduled[0].block_ids == [0, 1, 3, 2]
    assert plan(trace[8]) == [("b", 0, 9, True)]
    assert trace[8].scheduled[0].token_ids == b.prompt_token_ids + b.output_token_ids[:3]
    assert trace[8].scheduled[0].block_ids == [1, 2, 3]  # one allocation: in id order
    for req in (a, b):
        assert req.output_token_ids == [default_token(req.req_id, i) for i in range(8)]
    assert (b.num_preemptions, a.num_preemptions) == (1, 0)


def test_stop_conditions():
    cases = [  # scripted tokens, sampling params, expected outputs, finish reason, stop reason
        ([5, EOS, 7], {"max_tokens": 5}, [5, EOS], "stop", EOS),
        ([5, 7, 8], {"max_tokens": 5, "stop_token_ids": [7]}, [5, 7], "stop", 7),
        ([5, 6, 8, 9], {"max_tokens": 3}, [5, 6, 8], "length", None),
        ([EOS, EOS, EOS, 9], {"max_tokens": 5, "min_tokens": 3}, [EOS, EOS, EOS], "stop", EOS),
        (
            [5, 7, 9],
            {"max_tokens": 5, "min_tokens": 3, "stop_token_ids": [7]},
            [5, 7, 9, 1, 1],
            "length",
            None,
        ),
        ([EOS, EOS, EOS], {"max_tokens": 3, "ignore_eos": True}, [EOS, EOS, EOS], "length", None),
        ([EOS, 4], {"max_tokens": 3, "ignore_eos": True, "stop_token_ids": [4]}, [EOS, 4], "stop", 4),
        ([5, EOS], {"max_tokens": 2}, [5, EOS], "stop", EOS),  # a natural stop wins over length
    ]
    for script, params, expected, reason, stop_reason in cases:
        s = make_scheduler()
        r = FakeRunner(s, next_token=lambda req_id, i: 1)
        req = make_request("a", 3, **params)
        s.add_request(req)
        r.scripted["a"] = list(script)
        deltas = []
        while s.has_unfinished():
            deltas += step(s, r)[1]
        assert [d.new_token_ids[0] for d in deltas] == expected == req.output_token_ids, params
        assert [d.finished for d in deltas] == [False] * (len(expected) - 1) + [True]
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason, req.finish_reason) == (
            reason,
            stop_reason,
            reason,
        )
        assert s.kv_cache_manager.num_used_blocks == 0 and req.finished_time is not None


def test_abort_in_every_state():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8, prefill_chunk_size=4, policy="priority")
    r = FakeRunner(s)
    kv = s.kv_cache_manager
    waiting = make_request("waiting", 3)
    s.add_request(waiting)
    (out,) = s.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)
    assert (out.req_id, out.new_token_ids, out.finished, out.finish_reason) == ("waiting", [], True, "abort")
    assert not s.has_unfinished() and waiting.status == RequestStatus.FINISHED_ABORTED
    assert step(s, r)[0].finished_req_ids == ["waiting"]
    assert step(s, r)[0].finished_req_ids == []

    mid = make_request("mid_prefill", 12, priority=5)
    s.add_request(mid)
    step(s, r)
    assert mid.is_prefill and kv.num_used_blocks == 1
    s.finish_requests(["mid_prefill"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0 and s.num_running == 0
    s.check_integrity()

    dec = make_request("decoding", 3, max_tokens=8, priority=5)
    s.add_request(dec)
    step(s, r), step(s, r)
    assert not dec.is_prefill and dec.num_output_tokens == 2
    high = make_request("high", 3, max_tokens=8, priority=0)
    s.add_request(high)
    assert step(s, r)[0].preempted_req_ids == ["decoding"]
    assert s.finish_requests(["decoding"], RequestStatus.FINISHED_ABORTED)[0].finish_reason == "abort"
    assert dec.status == RequestStatus.FINISHED_ABORTED and s.waiting == []
    s.check_integrity()

    out = s.schedule()  # abort between schedule() and update(): the sampled token is dropped
    runner_out = r.execute(out)
    s.finish_requests(["high"], RequestStatus.FINISHED_ABORTED)
    assert s.update(out, runner_out) == [] and high.num_output_tokens == 1
    assert kv.num_used_blocks == 0 and not s.has_unfinished()
    assert s.finish_requests(["high", "unknown"], RequestStatus.FINISHED_ABORTED) == []  # no-ops
    assert high.status == RequestStatus.FINISHED_ABORTED
    s.check_integrity()
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_requests(["x"], RequestStatus.RUNNING)


def test_stop_string_finish_from_the_engine():
    s = make_scheduler()
    r = FakeRunner(s)
    s.add_request(make_request("a", 3, max_tokens=8))
    step(s, r)
    (out,) = s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert (out.finish_reason, out.stop_reason) == ("stop", "###")


def test_static_batching_waves():
    def first_steps(mode, max_num_seqs, budget, reqs):
        s = make_scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, batching_mode=mode)
        for name, n, max_tokens in reqs:
            s.add_request(make_request(name, n, max_tokens=max_tokens))
        trace = run_to_completion(s, FakeRunner(s))
        first = {}
        last = {}
        for i, out in enumerate(trace):
            for sr in out.scheduled:
                first.setdefault(sr.req_id, i)
                last[sr.req_id] = i
        return first, last

    reqs = [("r1", 3, 2), ("r2", 3, 6), ("r3", 3, 2), ("r4", 3, 2)]
    assert first_steps("continuous", 2, 16, reqs)[0] == {"r1": 0, "r2": 0, "r3": 2, "r4": 4}
    assert first_steps("static", 2, 16, reqs)[0] == {"r1": 0, "r2": 0, "r3": 6, "r4": 6}
    # A wave whose members are admitted over several steps (budget-limited) is still one wave.
    first, last = first_steps("static", 3, 4, [(f"r{i}", 4, 3) for i in range(1, 5)])
    assert first == {"r1": 0, "r2": 1, "r3": 2, "r4": max(last["r1"], last["r2"], last["r3"]) + 1}


def test_refusals():
    s = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(
        ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 exceeds max_model_len \(64\)"
    ):
        s.add_request(make_request("a", 60, max_tokens=5))
    with pytest.raises(
        ValueError, match=r"KV for up to 17 tokens .* at most 16 per request \(4 blocks of 4\)"
    ):
        s.add_request(make_request("b", 10, max_tokens=8))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(make_request("c", []))
    ok = make_request("d", 10, max_tokens=7)  # 16 tokens of KV: exactly the pool
    s.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("d", 3))
    run_to_completion(s, FakeRunner(s))
    with pytest.raises(ValueError, match="already run"):
        s.add_request(ok)
    assert not s.has_unfinished() and s.num_waiting == 0


def test_contiguous_backend_schedules_by_slot():
    s = make_scheduler(
        num_blocks=8, max_model_len=12, kv_cache_backend="contiguous", max_num_batched_tokens=16
    )
    r = FakeRunner(s)
    for name, max_tokens in [("a", 2), ("b", 6), ("c", 2)]:
        s.add_request(make_request(name, 4, max_tokens=max_tokens))
    out, _ = step(s, r)
    assert plan(out) == [("a", 0, 4, True), ("b", 0, 4, True)]  # 2 slots of 3 blocks: c waits
    assert [sr.block_ids for sr in out.scheduled] == [[0, 1, 2], [3, 4, 5]]
    assert (out.stats.num_blocks_used, out.stats.num_blocks_free, out.stats.num_blocks_cached) == (6, 2, 0)
    step(s, r)  # a finishes
    out, _ = step(s, r)
    assert plan(out) == [("b", 5, 1, True), ("c", 0, 4, True)] and out.scheduled[1].block_ids == [0, 1, 2]
    run_to_completion(s, r)
    assert s.kv_cache_manager.num_used_blocks == 0 and s.num_preemptions == 0


def test_prefix_hit_through_the_scheduler():
    s = make_scheduler()
    r = FakeRunner(s)
    s.add_request(make_request("a", 9, max_tokens=2))
    run_to_completion(s, r)
    b = make_request("b", 9, max_tokens=2)
    s.add_request(b)
    out, (delta,) = step(s, r)
    assert plan(out) == [("b", 8, 1, True)] and out.finished_req_ids == ["a"]
    assert b.num_cached_tokens == 8 and delta.num_cached_tokens == 8
    assert out.scheduled[0].block_ids[:2] == [0, 1]
    kv = s.kv_cache_manager
    assert (kv.num_queries, kv.num_hits, kv.num_query_tokens, kv.num_hit_tokens) == (2, 1, 18, 8)


def test_finished_ids_are_reported_once_at_the_next_step():
    s = make_scheduler()
    r = FakeRunner(s)
    s.add_request(make_request("a", 3, max_tokens=1))
    s.add_request(make_request("b", 3, max_tokens=3))
    out, deltas = step(s, r)
    assert [d.finished for d in deltas] == [True, False]
    assert step(s, r)[0].finished_req_ids == ["a"]
    assert step(s, r)[0].finished_req_ids == []
    assert step(s, r)[0].finished_req_ids == ["b"] and r.dropped == ["a", "b"]


def test_concurrent_requests_share_prefix_blocks():
    s = make_scheduler()
    r = FakeRunner(s)
    a = make_request("a", list(range(20, 29)), max_tokens=5)
    s.add_request(a)
    out, _ = step(s, r)
    assert out.scheduled[0].block_ids == [0, 1, 2]
    b = make_request("b", list(range(20, 28)) + [7, 7, 7], max_tokens=5)
    s.add_request(b)
    out, _ = step(s, r)
    assert plan(out) == [("a", 9, 1, True), ("b", 8, 3, True)]
    assert out.scheduled[1].block_ids == [0, 1, 3] and b.num_cached_tokens == 8
    assert [blk.ref_cnt for blk in s.kv_cache_manager.pool.blocks[:4]] == [2, 2, 1, 1]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [blk.ref_cnt for blk in s.kv_cache_manager.pool.blocks[:4]] == [1, 1, 0, 1]
    run_to_completion(s, r)
    assert b.output_token_ids == [default_token("b", i) for i in range(5)]
