"""The engine trace (infer.engine.trace) on the embedded model: the file is Chrome trace-event JSON, every
request's async slices begin, nest and end with its finish reason, step phases nest in their step, the
counters equal the scheduler's own counts at each step, and the ring keeps only the last N steps."""

from __future__ import annotations

import json

import pytest

from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams

# chunked prefill (chunks of 8 in a 16-token budget) and a pool small enough to preempt
CHUNKED = dict(
    max_num_batched_tokens=16, prefill_chunk_size=8, max_num_seqs=4, block_size=4, num_kv_blocks=24
)
PROMPTS = [[10 + i] * n for i, n in enumerate((30, 20, 9, 44, 5))]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
REQUIRED = {"name", "ph", "ts", "pid", "tid"}
EPS = 0.01  # microseconds: ts and dur are rounded to the nanosecond


def async_slices(events: list[dict]) -> dict[str, list[tuple[str, float, float, dict, int]]]:
    """req_id -> its slices (name, begin, end, begin args | end args, depth), each e matched to the
    innermost open b of its id, which must have the same name."""
    stacks: dict[str, list[dict]] = {}
    slices: dict[str, list] = {}
    for e in sorted((e for e in events if e["ph"] in "be"), key=lambda e: e["ts"]):  # stable: file order
        stack = stacks.setdefault(e["id"], [])
        if e["ph"] == "b":
            stack.append(e)
            continue
        assert stack, f"an e without its b: {e}"
        begin = stack.pop()
        assert begin["name"] == e["name"] and begin["ts"] <= e["ts"], (begin, e)
        args = {**begin.get("args", {}), **e.get("args", {})}
        slices.setdefault(e["id"], []).append((e["name"], begin["ts"], e["ts"], args, len(stack)))
    assert not any(stacks.values()), f"slices never ended: {stacks}"
    return slices


def steps_and_phases(events: list[dict]) -> list[tuple[dict, list[dict]]]:
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    phases = [e for e in events if e["ph"] == "X" and e["name"] != "step"]
    out = []
    for step in steps:
        inside = [p for p in phases if step["ts"] - EPS <= p["ts"] < step["ts"] + step["dur"] + EPS]
        out.append((step, inside))
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A traced run of PROMPTS, with the scheduler's counts after every schedule() (check_integrity'd)."""
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    llm = LLM(trace_path=str(path), **CHUNKED)
    sched = llm.engine.scheduler
    counts, schedule = [], sched.schedule

    def checked_schedule():
        out = schedule()
        sched.check_integrity()
        kv = sched.kv_cache_manager
        counts.append((sched.num_running, sched.num_waiting, kv.num_used_blocks, kv.num_free_blocks))
        return out

    sched.schedule = checked_schedule
    with llm:
        results = llm.generate(PROMPTS, PARAMS)
    return json.loads(path.read_text()), results, counts


def test_the_file_is_chrome_trace_event_json(traced):
    trace, _, _ = traced
    events = trace["traceEvents"]
    assert events and all(set(e) >= REQUIRED for e in events)
    assert {e["ph"] for e in events} == {"M", "X", "C", "b", "e", "i"}  # "i": a preemption happened
    for e in events:
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] in "be":
            assert isinstance(e["id"], str) and e["cat"] == "request"


def test_each_request_begins_nests_and_ends_with_its_finish_reason(traced):
    trace, results, _ = traced
    slices = async_slices(trace["traceEvents"])
    assert len(slices) == len(PROMPTS)
    for result in results:
        req = result.request
        mine = slices[req.req_id]
        outer = [s for s in mine if s[4] == 0]
        assert len(outer) == 1 and outer[0][0] == req.req_id
        _, begin, end, args, _ = outer[0]
        assert args["finish_reason"] == result.finish_reason == "length"
        assert args["prompt_tokens"] == len(result.prompt)
        assert args["output_tokens"] == len(result.token_ids) == PARAMS.max_tokens
        assert args["cached_tokens"] == result.num_cached_tokens
        assert args["preemptions"] == req.num_preemptions
        inner = sorted((s for s in mine if s[4] == 1), key=lambda s: s[1])
        assert all(begin <= s[1] <= s[2] <= end for s in inner)
        assert all(a[2] <= b[1] for a, b in zip(inner, inner[1:], strict=False)), "phases overlap"
        names = [s[0] for s in inner]
        assert (
            names[0] == "queued" and names[-1] == "decode" and names.count("preempted") == req.num_preemptions
        )
        prefilled = sum(s[3]["tokens"] for s in inner if s[0] == "prefill")
        assert prefilled == req.num_prefill_tokens_computed
    chunks = {rid: [s for s in mine if s[0] == "prefill"] for rid, mine in slices.items()}
    assert max(len(c) for c in chunks.values()) >= 4  # the 44-token prompt, in chunks of at most 8
    assert sum(r.request.num_preemptions for r in results) >= 1


def test_step_phases_nest_in_their_step(traced):
    trace, _, counts = traced
    pairs = steps_and_phases(trace["traceEvents"])
    assert len(pairs) == len(counts)
    for step, phases in pairs:
        assert [p["name"] for p in phases] == ["schedule", "prepare", "forward", "update", "detokenize"]
        for p in phases:
            assert step["ts"] - EPS <= p["ts"] and p["ts"] + p["dur"] <= step["ts"] + step["dur"] + EPS
        assert {"requests", "prefill_tokens", "decode_tokens", "preemptions", "prefix_hit_tokens"} <= set(
            step["args"]
        )
        args = step["args"]  # the step's share of the token budget: every scheduled token, within it
        assert args["budget_used"] == args["prefill_tokens"] + args["decode_tokens"] <= args["budget"]
        assert args["budget"] == CHUNKED["max_num_batched_tokens"]
    assert [s["args"]["step"] for s, _ in pairs] == list(range(len(pairs)))


def test_counters_equal_the_schedulers_counts_at_each_step(traced):
    trace, _, counts = traced
    events = trace["traceEvents"]
    by_name = {
        n: [e["args"] for e in events if e["ph"] == "C" and e["name"] == n]
        for n in ("requests", "kv_blocks", "tokens")
    }
    assert all(len(v) == len(counts) for v in by_name.values())
    traced_counts = [
        (r["running"], r["waiting"], kv["used"], kv["free"])
        for r, kv in zip(by_name["requests"], by_name["kv_blocks"], strict=True)
    ]
    assert traced_counts == counts
    steps = [e["args"] for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert [(t["prefill"], t["decode"]) for t in by_name["tokens"]] == [
        (s["prefill_tokens"], s["decode_tokens"]) for s in steps
    ]
    assert all(0 < t["prefill"] + t["decode"] <= CHUNKED["max_num_batched_tokens"] for t in by_name["tokens"])


def test_the_ring_keeps_the_last_n_steps_and_every_e_its_b(tmp_path):
    path = tmp_path / "ring.json"
    with LLM(trace_path=str(path), trace_steps=5, **CHUNKED) as llm:
        llm.generate(PROMPTS[:2], PARAMS)
        num_steps = llm.engine.trace._num_steps
        window_start = [e for e in llm.engine.trace.events() if e["name"] == "step"][-2]["ts"]
        window = llm.engine.trace.events(since_us=window_start)
    assert num_steps > 5
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e["args"]["step"] for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert steps == list(range(num_steps - 5, num_steps))
    slices = async_slices(events)  # every e has its b: the lost beginnings are re-begun, marked
    assert set(slices) == {"req-0", "req-1"}
    assert any(s[3].get("truncated") for mine in slices.values() for s in mine)
    assert [e["args"]["step"] for e in window if e["name"] == "step"] == [num_steps - 2, num_steps - 1]
    async_slices(window)


def test_an_abort_ends_the_requests_slices(tmp_path):
    llm = LLM(trace_path=str(tmp_path / "abort.json"), **CHUNKED)
    reqs = [llm.engine.add_request(p, PARAMS) for p in PROMPTS[:3]]
    llm.engine.step()  # two 8-token chunks fill the budget: the third request is still queued
    llm.engine.abort([r.req_id for r in reqs])
    llm.close()
    slices = async_slices(json.loads((tmp_path / "abort.json").read_text())["traceEvents"])
    for req, last_phase in zip(reqs, ("prefill", "prefill", "queued"), strict=True):
        outer = [s for s in slices[req.req_id] if s[4] == 0]
        assert outer[0][3]["finish_reason"] == "abort"
        assert max((s for s in slices[req.req_id] if s[4] == 1), key=lambda s: s[1])[0] == last_phase


def test_off_by_default():
    llm = LLM(max_num_seqs=2)
    assert llm.engine.trace is None
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    llm.close()  # nothing to write
