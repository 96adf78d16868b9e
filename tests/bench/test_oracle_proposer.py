"""The micro-benchmark's oracle proposer: the target's own continuation at a chosen acceptance. Its
proposals on their own (fast), then on engines of a toy through `speculative-decoding --oracle`, counted
from the scheduler's spec-decode counters (what /metrics exports)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from infer.bench.micro import counts, main
from infer.bench.micro.oracle_proposer import OracleProposer
from infer.models.toy import build_toy

PROMPT = [5, 6, 7]
TRUTH = list(range(100, 140))
VOCAB = 1000


def oracle(k: int, acceptance: float | None) -> OracleProposer:
    o = OracleProposer(k, VOCAB, acceptance)
    o.learn(PROMPT, TRUTH)
    o.learn([5, 6, 8, 9], [1, 2, 3, 4])  # another prompt, another length
    return o


def test_acceptance_one_proposes_the_continuation_from_where_the_sequence_is():
    o = oracle(3, 1.0)
    assert o.propose(PROMPT) == TRUTH[:3]
    assert o.propose(PROMPT + TRUTH[:5]) == TRUTH[5:8]
    assert o.propose(PROMPT + TRUTH[:5], max_tokens=2) == TRUTH[5:7]
    assert o.propose([5, 6, 8, 9, 1]) == [2, 3, 4]
    assert o.propose(PROMPT + TRUTH[:38]) == TRUTH[38:]  # the continuation's end


def test_acceptance_zero_proposes_k_tokens_all_wrong():
    o = oracle(4, 0.0)
    for done in range(30):
        proposals = o.propose(PROMPT + TRUTH[:done])
        truth = TRUTH[done : done + 4]
        assert len(proposals) == 4 and all(p != t for p, t in zip(proposals, truth, strict=True))


def test_a_prompt_never_learned_and_plain_mode_propose_nothing():
    assert oracle(3, 1.0).propose([9, 9, 9, 9]) == []
    assert oracle(3, None).propose(PROMPT) == []
    assert oracle(3, 1.0).propose(PROMPT, max_tokens=0) == []


def test_acceptance_is_geometric_and_the_same_on_every_call():
    """Right at each position with probability a until the first wrong one, wrong from there on; the
    draws depend on (prompt, position) only, so a repeat of a workload proposes the same tokens."""
    o = OracleProposer(3, VOCAB, 0.5)
    right = [0, 0, 0, 0]
    for p in range(400):
        prompt = [p, p + 1]
        o.learn(prompt, TRUTH)
        proposals = o.propose(prompt)
        assert proposals == o.propose(prompt)
        n = next((j for j, (a, b) in enumerate(zip(proposals, TRUTH, strict=False)) if a != b), 3)
        assert all(a != b for a, b in zip(proposals[n:], TRUTH[n:3], strict=True))  # wrong after it
        right[n] += 1
    # P(n right) = 0.5**(n+1) for n < 3, 0.125 for all 3: 200, 100, 50, 50 of 400
    assert 160 < right[0] < 240 and 70 < right[1] < 130 and 25 < right[2] < 75 and 25 < right[3] < 75


@pytest.mark.slow  # trains a toy, then runs K = 1..4 at five acceptances twice each, one and three streams
def test_oracle_bench_accepts_all_at_one_none_at_zero_and_keeps_greedy_output(tmp_path):
    toy = build_toy(tmp_path / "toy", train_seconds=1.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["speculative-decoding", "--model", str(toy), "--dtype", "float32", "--scale", "small"]
        args += ["--oracle", "--streams", "1,3", "--repeats", "2", "--no-report"]
        args += ["--json", str(tmp_path / "r.json")]
        assert main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["oracle"] == [1, 2, 3, 4]
    found = {c["name"]: c for c in doc["benchmarks"]["speculative-decoding"]["cases"]}
    assert set(found) == {f"oracle_k{k}@{n}" for k in (1, 2, 3, 4) for n in (1, 3)}
    for name, case in found.items():
        k, streams, modes = case["knobs"]["k"], case["knobs"]["streams"], case["modes"]
        assert set(modes) == {"plain", "a=0", "a=0.5", "a=0.8", "a=1", "a=0 gated", "a=0.8 gated"}, name
        assert modes["plain"]["drafted"] == 0, name
        for mode, m in modes.items():
            assert m["same_as_plain"] == streams, (name, mode)  # greedy output is plain decoding's
            assert m["gen_tok"] == modes["plain"]["gen_tok"], (name, mode)
        one, zero = modes["a=1"], modes["a=0"]
        assert one["drafts"] > 0 and one["accepted"] == one["drafted"] <= k * one["drafts"], name
        # nothing accepted: K proposals a step, fewer only in a stream's last K - 1 (max_tokens is near)
        assert zero["drafts"] > 0 and zero["accepted"] == 0, name
        assert zero["per_pos"] == ", ".join(["0.00"] * k) and one["per_pos"].startswith("1.00"), name
        assert zero["drafted"] == k * zero["drafts"] - streams * k * (k - 1) // 2, name
        assert one["steps"] < modes["plain"]["steps"] or k == 0, name  # accepted tokens save steps
        assert 0 < modes["a=0.5"]["accepted"] < modes["a=0.5"]["drafted"], name
        # every step speculates but where the gate decides: it measures plain steps too (MIN_PLAIN)
        assert modes["a=0"]["speculated"] == 1.0 and 0 < modes["a=0 gated"]["speculated"] < 1.0, name
    assert "oracle" in out.getvalue()
    assert all(v["passed"] for v in doc["benchmarks"]["speculative-decoding"]["verdicts"])


def test_oracle_and_streams_take_comma_separated_counts():
    assert counts("--oracle", "1,2,3,4") == (1, 2, 3, 4) and counts("--streams", None) == ()
    for bad in ("0", "1,x", ""):
        with pytest.raises(ValueError, match="--streams takes"):
            counts("--streams", bad)
    assert main(["speculative-decoding", "--oracle", "2,0", "--no-report"]) == 2
