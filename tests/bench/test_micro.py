"""The micro-benchmarks end to end on their shrunken cases (`--scale small`, one repeat), through the
command line and its JSON report. Each test checks the COUNTS a benchmark reports against what the case's
configuration implies; timings are never asserted (they are a benchmark's business, not a test's)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest

from infer.bench.micro import BENCHMARKS, add_micro_parser, main
from infer.bench.micro import scheduling as sched_bench
from infer.bench.micro.harness import best_of, percentile
from infer.bench.micro.report import render_table
from infer.bench.request_timeline import load_trace, request_timelines
from infer.models.toy import build_toy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("micro")
    toy = build_toy(tmp / "toy", train_seconds=1.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            [
                "all",
                "--model",
                str(toy),
                "--dtype",
                "float32",
                "--scale",
                "small",
                "--json",
                str(tmp / "r.json"),
                "--trace",
                str(tmp / "traces"),
            ]
        )
    assert rc == 0
    doc = json.loads((tmp / "r.json").read_text())
    return doc, out.getvalue()


def cases(report, name: str) -> dict[str, dict]:
    return {c["name"]: c for c in report[0]["benchmarks"][name]["cases"]}


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_every_benchmark_prints_its_tables_and_one_verdict_per_case(report):
    doc, text = report
    assert set(doc["benchmarks"]) == set(BENCHMARKS)
    assert doc["meta"]["scale"] == "small" and doc["meta"]["repeats"] == 1
    for name, bench in doc["benchmarks"].items():
        verdict_cases = [v["case"] for v in bench["verdicts"]]
        assert [c["name"] for c in bench["cases"]] == verdict_cases[: len(bench["cases"])], name
        for v in bench["verdicts"]:
            assert v["line"].startswith(("PASS ", "MISS ")) and f"[{name}] {v['line']}" in text
    assert "method   | tokens | wall_time_s | tokens_per_s | ttft_ms" in text  # the reference's table
    assert "##### Verdicts #####" in text


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_kv_cache_counts(report):
    doc, _ = report
    bench = doc["benchmarks"]["kv-cache"]
    for case in bench["cases"] + bench["sweep"]:
        prompt_len, n = case["knobs"]["prompt_len"], case["knobs"]["N"]
        for mode in ("no_cache", "kv_cache"):
            m = case["modes"][mode]
            assert (m["reqs"], m["done"], m["gen_tok"], m["prompt_tok"]) == (1, 1, n, prompt_len), case[
                "name"
            ]
            # the prompt once, then one token per step; nothing cached, nothing preempted
            assert m["prefill_computed"] == prompt_len and m["steps"] == n
            assert m["cached_tok"] == m["preempt"] == m["evictions"] == 0


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_continuous_batching_completes_every_request(report):
    doc, _ = report
    bench = doc["benchmarks"]["continuous-batching"]
    for case in bench["cases"] + bench["sweep"]:
        k = case["knobs"]
        n, batch, new = k["num_requests"], k["max_batch_size"], k["max_new_tokens"]
        seq, cont = case["modes"]["single_request_sequential"], case["modes"]["continuous_batching"]
        for m in (seq, cont):
            assert m["done"] == m["reqs"] == n, case["name"]  # the reference completed as few as 9/32
            assert m["gen_tok"] == n * new and m["prefill_computed"] == n * k["prompt_len"]
            assert m["preempt"] == 0
        assert seq["max_batch"] == 1 and seq["steps"] == n * new
        # all arrive at step 0: waves of `batch` requests that prefill together and finish together
        assert cont["max_batch"] == min(batch, n) and cont["steps"] == cdiv(n, batch) * new


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_chunked_prefill_counts(report):
    doc, _ = report
    for name, case in cases(report, "chunked-prefill").items():
        k = case["knobs"]
        num_short, num_long = k["num_short_requests"], k["num_long_requests"]
        prompt_tok = num_short * k["short_prompt_len"] + num_long * k["long_prompt_len"]
        gen_tok = num_short * k["short_max_new_tokens"] + num_long * k["long_max_new_tokens"]
        for m in case["modes"].values():
            assert m["done"] == m["reqs"] == num_short + num_long, name
            assert (m["prompt_tok"], m["gen_tok"], m["prefill_computed"]) == (prompt_tok, gen_tok, prompt_tok)
            assert m["preempt"] == 0
        # chunked: no step over the token budget; normal: whole prompts, all long ones in one step beside
        # the decodes of the short requests (still running when the long ones arrive)
        assert case["modes"]["chunked_prefill"]["max_step_tokens"] <= k["token_budget"]
        assert k["short_max_new_tokens"] > k["long_arrival_step"]
        largest = max(num_short * k["short_prompt_len"], num_long * k["long_prompt_len"] + num_short)
        assert case["modes"]["normal_prefill"]["max_step_tokens"] == largest
        # whole prompts: every first token comes from the step a request joins (its prefill step)
        assert case["modes"]["normal_prefill"]["ttft_steps"] == 1
        # chunked: a long prompt needs at least long_prompt_len / chunk_size steps to its first token
        long_steps = cdiv(k["long_prompt_len"], min(k["chunk_size"], k["token_budget"]))
        least = (num_short + num_long * long_steps) / (num_short + num_long)
        assert case["modes"]["chunked_prefill"]["ttft_steps"] >= least
        assert case["ratios"]["step_ceiling"] == pytest.approx(
            case["modes"]["normal_prefill"]["steps"] / case["modes"]["chunked_prefill"]["steps"]
        )


def memory_pressure(knobs: dict, vocab_size: int = 60) -> bool:
    """Can the max_batch_size largest requests outgrow the KV pool together?"""
    specs = sched_bench.workload(knobs["workload_name"], vocab_size)
    bs = sched_bench.BLOCK_SIZE
    blocks = sorted((cdiv(len(s.prompt_ids) + s.max_tokens - 1, bs) for s in specs), reverse=True)
    return sum(blocks[: knobs["max_batch_size"]]) > knobs["max_kv_tokens"] // bs


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_scheduling_counts(report):
    doc, _ = report
    found = cases(report, "scheduling")
    assert set(found) == set(sched_bench.CASES)
    for name, case in found.items():
        specs = sched_bench.workload(case["knobs"]["workload_name"], 60)
        fcfs, prio = case["modes"]["fcfs"], case["modes"]["priority"]
        for m in (fcfs, prio):
            assert m["done"] == m["reqs"] == len(specs), name
            assert m["gen_tok"] == sum(s.max_tokens for s in specs)
            assert m["max_batch"] <= case["knobs"]["max_batch_size"]
            recomputed = m["prefill_computed"] - m["prompt_tok"]
            assert recomputed == 0 if m["preempt"] == 0 else recomputed > 0
        pressure = memory_pressure(case["knobs"])
        assert (fcfs["preempt"] > 0) == pressure, name  # FCFS preempts only to free memory
        if name == "equal_priority_control":
            assert prio["preempt"] == 0 and case["ratios"]["identical_schedule"]
            assert prio["hi_lat_steps"] == fcfs["hi_lat_steps"]
        else:
            assert prio["preempt"] >= max(1, fcfs["preempt"] if pressure else 0), name
            assert prio["hi_lat_steps"] < fcfs["hi_lat_steps"], name  # urgent requests finish sooner
            # ... as soon as with the less urgent requests removed: strict priority leaves nothing to cut
            assert prio["hi_lat_steps"] == case["ratios"]["hi_floor_steps"], name
            assert not case["ratios"]["identical_schedule"]
    assert memory_pressure(found["memory_pressure_preemption"]["knobs"])


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_prefix_caching_counts(report):
    doc, _ = report
    for name, case in cases(report, "prefix-caching").items():
        k = case["knobs"]
        n, bs, new = k["num_requests"], k["prefix_block_size"], k["max_new_tokens"]
        prompt_len = k["shared_prefix_len"] + k["unique_suffix_len"]
        base, cached = case["modes"]["no_prefix_cache"], case["modes"]["prefix_cache"]
        for m in (base, cached):
            assert (
                m["done"] == m["reqs"] == n and m["prompt_tok"] == n * prompt_len and m["gen_tok"] == n * new
            )
            assert m["prefill_computed"] == m["prompt_tok"] - m["cached_tok"] and m["preempt"] == 0
        assert base["cached_tok"] == base["evictions"] == base["hits"] == base["lookups"] == 0
        if name == "eviction_pressure":  # each group's prefix is evicted before the group comes back
            expected = 0
            assert k["num_groups"] * cdiv(prompt_len + new - 1, bs) > k["max_cache_blocks"]
            assert cached["evictions"] > 0
        else:  # every request after the first of its group reuses the whole block-aligned shared prefix
            expected = (n - k["num_groups"]) * (k["shared_prefix_len"] // bs) * bs
        assert cached["cached_tok"] == expected, name
        assert cached["hits"] * bs == expected
        # every full block computed is cached once; it is either still cached at the end or was evicted
        full_blocks = n * ((prompt_len + new - 1) // bs)
        assert cached["evictions"] == full_blocks - cached["hits"] - cached["blocks"], name


def test_best_of_keeps_the_best_timing_and_refuses_counts_that_differ():
    a = {"gen_tok": 8, "tok_s": 10.0, "wall_s": 0.8, "avg_ttft_ms": 3.0, "decode_tok_s": 5.0}
    b = {"gen_tok": 8, "tok_s": 12.0, "wall_s": 0.7, "avg_ttft_ms": 4.0, "decode_tok_s": 6.0}
    best = {"gen_tok": 8, "tok_s": 12.0, "wall_s": 0.7, "avg_ttft_ms": 3.0, "decode_tok_s": 6.0}
    assert best_of([a, b]) == best
    with pytest.raises(RuntimeError, match="gen_tok"):
        best_of([a, b | {"gen_tok": 9}])


def test_percentile_and_table_follow_the_seeds():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.95) == 5.0 and percentile([], 0.5) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0  # index round(1.5) = 2
    table = render_table(["method", "tokens"], [["no_cache", "16"], ["kv_cache", "16"]])
    assert table.splitlines() == ["method   | tokens", "---------+-------", "no_cache | 16", "kv_cache | 16"]


def test_micro_parser_plugs_into_a_cli():
    parser = argparse.ArgumentParser(prog="infer bench")
    add_micro_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["micro", "chunked-prefill", "--scale", "small", "--json", "out.json"])
    assert args.benchmark == "chunked-prefill" and args.scale == "small" and callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["micro", "no-such-benchmark"])


@pytest.mark.slow  # runs every micro-benchmark on a toy model trained for it
def test_traces_of_each_engine_setting_and_their_timelines(report):
    """`--trace DIR`: every benchmark leaves one trace per engine setting (its last run), each holding
    every request of that run; the HTML report beside the JSON draws a timeline for each."""
    doc = report[0]
    trace_dir = Path(doc["meta"]["trace_dir"])
    traces = sorted(trace_dir.glob("*.trace.json"))
    assert all(any(t.name.startswith(f"{name}-") for t in traces) for name in BENCHMARKS)
    for trace in traces:
        timelines = request_timelines(load_trace(trace))
        assert timelines and all(t.segments for t in timelines), trace.name
    html = (trace_dir.parent / "r.html").read_text()
    assert all(f"{t.name}: per-request timeline" in html for t in traces)


@pytest.mark.slow  # trains a toy, then runs the benchmark's small cases twice per mode
def test_speculative_decoding_takes_a_draft_model_and_counts_each_run_alone(tmp_path):
    """The toy as its own draft: every proposal accepted, K per verification; two repeats on one engine
    per mode report the same counts (each run's own, not the engine's totals)."""
    toy = build_toy(tmp_path / "toy", train_seconds=1.0)
    config = {"method": "draft_model", "model": str(toy), "num_speculative_tokens": 2}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["speculative-decoding", "--model", str(toy), "--dtype", "float32", "--scale", "small"]
        args += ["--repeats", "2", "--no-report", "--json", str(tmp_path / "r.json")]
        rc = main([*args, "--speculative-config", json.dumps(config)])
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["speculative_config"] == config
    found = {c["name"]: c for c in doc["benchmarks"]["speculative-decoding"]["cases"]}
    assert set(found) == {f"{w}@{n}" for w in ("repeat_text", "code", "free_text") for n in (1, 8)}
    for name, case in found.items():
        assert case["knobs"]["method"] == "draft_model"
        plain = case["modes"]["plain"]
        spec = case["modes"]["draft_model_always"]  # every step speculates (the gated mode: by timing)
        assert plain["drafted"] == 0 and plain["gen_tok"] == spec["gen_tok"], name
        assert spec["runs"] == 2 and spec["drafts"] > 0, name
        # K = 2 each, fewer only where max_tokens is near
        assert spec["accepted"] == spec["drafted"] and spec["drafts"] < spec["drafted"] <= 2 * spec["drafts"]
        assert spec["per_pos"].startswith("1.00, "), name
    assert "plain vs draft_model" in out.getvalue()
