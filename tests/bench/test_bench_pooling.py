"""`infer bench race --workload embeddings | rerank`: the workload's logic as pure functions (points,
batches, answers, figures, notes), exact-length texts for tokenizers that add [CLS] ... [SEP] or a
trailing EOS, and one race end to end against our own server on a tiny BERT.

No test needs vLLM or llama.cpp, and none asserts a timing."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from infer.bench import pooling_workload as pw
from infer.bench import race
from infer.bench.pooling_workload import Point, PoolingRecord
from infer.bench.prompts import exact_prompts
from infer.engine.tokenizer import load_tokenizer
from tests.models.pooling_models import _tokenizer, build_cross_encoder, build_embedder


def rec(i: int, n: int, sent: float, end: float, status: str = "ok", tokens: int | None = None):
    return PoolingRecord(i, n, sent, end, status, 200 if status == "ok" else 500,
                         None if status == "ok" else "boom", tokens, n)  # fmt: skip


# ---- pure logic ----------------------------------------------------------------------------------------


def test_points_cover_every_length_batch_and_concurrency_in_order():
    assert pw.points([128, 512], [1, 32], [1]) == [
        Point(128, 1, 1), Point(128, 32, 1), Point(512, 1, 1), Point(512, 32, 1),
    ]  # fmt: skip
    assert pw.parse_counts("1, 32,256", "--batch-sizes") == [1, 32, 256]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            pw.parse_counts(bad, "--batch-sizes")


def test_batches_take_consecutive_texts_and_wrap_around():
    texts = ["a", "b", "c", "d", "e"]
    assert pw.batches_of(texts, 2, 3) == [["a", "b"], ["c", "d"], ["e", "a"]]
    assert pw.batches_of(texts, 3, 1, start=4) == [["e", "a", "b"]]
    assert all(len(set(b)) == 5 for b in pw.batches_of(texts, 5, 4))  # never a text twice in one request
    with pytest.raises(ValueError):
        pw.batches_of([], 1, 1)


def test_bodies_are_openais_embeddings_and_cohere_rerank():
    emb = pw.PoolingClient("http://x/", "m", "embeddings")
    assert emb.url == "http://x/v1/embeddings"
    assert emb.body(["a", "b"]) == {"model": "m", "input": ["a", "b"], "encoding_format": "float"}
    rr = pw.PoolingClient("http://x", "m", "rerank", query="q")
    assert rr.url == "http://x/v1/rerank"
    assert rr.body(["a", "b"]) == {"model": "m", "query": "q", "documents": ["a", "b"], "top_n": 2}
    with pytest.raises(ValueError, match="unknown pooling workload"):
        pw.PoolingClient("http://x", "m", "generate")


def test_an_answer_must_hold_one_result_per_input():
    r = PoolingRecord(0, 2)
    pw.read_answer({"data": [{}, {}], "usage": {"prompt_tokens": 256}}, r)
    assert r.ok and r.num_results == 2 and r.num_prompt_tokens == 256
    r = PoolingRecord(0, 3)
    pw.read_answer({"results": [{}, {}, {}], "usage": {"prompt_tokens": 9}}, r)  # rerank's shape
    assert r.ok and r.num_results == 3
    r = PoolingRecord(0, 3)
    pw.read_answer({"data": [{}]}, r)
    assert not r.ok and r.error == "1 results for 3 inputs" and r.num_prompt_tokens is None


def test_docs_per_second_spans_first_send_to_last_answer_and_counts_only_answered_docs():
    records = [
        rec(0, 32, 0.0, 2.0, tokens=4096),
        rec(1, 32, 1.0, 4.0, tokens=4096),
        rec(2, 32, 1.5, 3.0, "error"),
    ]
    s = pw.summarize(records)
    assert (s["num_ok"], s["num_errors"], s["num_docs"], s["duration_s"]) == (2, 1, 64, 4.0)
    assert s["docs_per_s"] == 16.0 and s["prompt_tokens_per_s"] == 2048.0
    assert s["latency_ms"]["p50"] == 2500.0 and s["latency_ms"]["count"] == 2  # the failed one left out
    empty = pw.summarize([])
    assert empty["docs_per_s"] is None and empty["latency_ms"]["p99"] is None


def test_token_counts_flag_embeddings_whose_usage_is_not_batch_times_tokens():
    p = Point(128, 2, 1)
    good, off = rec(0, 2, 0, 1, tokens=256), rec(1, 2, 0, 1, tokens=254)
    assert pw.token_counts([good, off], p, "embeddings") == {
        "prompt_tokens_seen": [254, 256], "expected": 256, "num_prompt_mismatch": 1,
    }  # fmt: skip
    assert pw.token_counts([off], p, "rerank")["num_prompt_mismatch"] == 0  # the query is counted too


def result(p: Point, docs_s: float | None, p50: float = 100.0, p99: float = 200.0, errors: int = 0) -> dict:
    summary = {"docs_per_s": docs_s, "latency_ms": {"p50": p50, "p99": p99}, "num_errors": errors}
    requests = [{"status": "error", "error": "boom"}] if errors else []
    counts = {
        "prompt_tokens_seen": [p.tokens * p.batch],
        "expected": p.tokens * p.batch,
        "num_prompt_mismatch": 0,
    }
    return {"tokens": p.tokens, "batch": p.batch, "concurrency": p.concurrency, "summary": summary,
            "token_counts": counts, "requests": requests}  # fmt: skip


def test_figures_keep_every_round_and_the_ratio_is_of_medians():
    a, b = Point(128, 1, 1), Point(128, 32, 1)
    runs = [
        {"side": "infer", "round": 0, "error": None, "results": [result(a, 10.0, 90.0), result(b, 300.0)]},
        {"side": "peer", "round": 0, "error": None, "results": [result(a, 5.0), result(b, 100.0)]},
        {"side": "peer", "round": 1, "error": None, "results": [result(a, 7.0), result(b, 200.0)]},
        {"side": "infer", "round": 1, "error": None, "results": [result(a, 12.0, 110.0), result(b, None)]},
    ]
    fa, fb = pw.race_figures(runs, [a, b])
    assert fa["infer"]["docs_s"] == [10.0, 12.0] and fa["peer"]["docs_s"] == [5.0, 7.0]
    assert fa["ratio"] == pytest.approx(11.0 / 6.0) and fa["infer"]["latency_p50_ms"] == 100.0
    assert fb["infer"]["docs_s"] == [300.0] and fb["ratio"] == pytest.approx(2.0)
    rows = pw.race_rows([fa, fb], "bge")
    assert rows[0][:7] == ["bge", 128, 1, 1, "10.0 / 12.0", "5.0 / 7.0", "1.83"]
    alone = pw.race_figures(runs[:1], [a])[0]
    assert alone["peer"]["docs_s"] == [] and alone["ratio"] is None


def test_notes_name_failed_starts_failed_requests_and_wrong_counts():
    p = Point(512, 32, 1)
    bad = result(p, 1.0, errors=1)
    bad["token_counts"] = {"prompt_tokens_seen": [16000], "expected": 16384, "num_prompt_mismatch": 1}
    runs = [
        {"side": "peer", "round": 0, "error": "the server exited with 1", "results": []},
        {"side": "infer", "round": 0, "error": None, "results": [bad]},
    ]
    assert pw.notes(runs) == [
        "round 1 peer: the server exited with 1",
        "round 1 infer 512 tokens x 32 c=1: 1 requests failed (boom)",
        "round 1 infer 512 tokens x 32 c=1: usage counted [16000] prompt tokens, not 16384",
    ]


def test_the_workload_flags_and_their_defaults():
    parser = race.argparse.ArgumentParser()
    race.add_arguments(parser)
    args = parser.parse_args(["--workload", "embeddings", "--batch-sizes", "1,8"])
    race.resolve_defaults(args)
    assert (args.num_requests, args.concurrencies, args.batch_sizes, args.input_tokens) == (
        4, [1], [1, 8], [128, 512],
    )  # fmt: skip
    args = parser.parse_args([])
    race.resolve_defaults(args)
    assert (args.workload, args.num_requests, args.concurrencies) == ("generate", 32, [1, 8, 32])
    with pytest.raises(ValueError, match="--input-tokens"):
        race.resolve_defaults(parser.parse_args(["--workload", "rerank", "--input-tokens", "0"]))


# ---- exact texts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_texts_have_exactly_the_asked_tokens_with_the_special_tokens_around_them(kind, tmp_path):
    _tokenizer(tmp_path, kind)  # BERT's [CLS] A [SEP]; a decoder embedder's A EOS
    tok = load_tokenizer(tmp_path)
    texts = exact_prompts(tok, 12, 64, seed=1)
    ids = [tok.encode(t) for t in texts]
    assert all(len(x) == 64 for x in ids)
    assert len({x[-1] for x in ids}) == 1  # each ends with the special token the tokenizer adds
    assert len({tuple(x[:16]) for x in ids}) == 12


# ---- end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow  # builds two models and launches our server twice
@pytest.mark.parametrize("workload", ["embeddings", "rerank"])
def test_pooling_race_end_to_end_against_our_server(workload, tmp_path, monkeypatch):
    monkeypatch.setattr(race, "find_vllm", lambda: None)  # never start a vLLM that happens to be installed
    folder = tmp_path / "model"
    if workload == "embeddings":
        build_embedder(folder, "bert")
    else:
        build_cross_encoder(folder, "bert")
    path = tmp_path / "race.json"
    argv = [str(folder), "--workload", workload, "--input-tokens", "16,48", "--batch-sizes", "1,5",
            "--num-requests", "2", "--query-tokens", "8", "--rounds", "1", "--out", str(path),
            "--no-progress"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = race.main(argv)
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    assert f"race, {workload}" in text and "infer docs/s" in text and "note:" not in text, text

    report = json.loads(path.read_text())
    assert report["kind"] == "race" and report["config"]["workload"] == workload
    (run,) = report["runs"]
    assert run["error"] is None and run["warmup"] == {"num_requests": 2, "num_ok": 2}
    assert [(x["tokens"], x["batch"]) for x in run["results"]] == [(16, 1), (16, 5), (48, 1), (48, 5)]
    for x in run["results"]:
        assert x["summary"]["num_ok"] == 2 and x["summary"]["num_docs"] == 2 * x["batch"]
        if workload == "embeddings":  # the server's own count: exactly the asked tokens per text
            assert {r["num_prompt_tokens"] for r in x["requests"]} == {x["tokens"] * x["batch"]}
    assert all(f["infer"]["docs_s"][0] > 0 and f["ratio"] is None for f in report["figures"])
    assert path.with_suffix(".html").is_file()


@pytest.mark.slow  # builds a model and launches our server
def test_bench_serve_runs_the_pooling_workloads_against_a_running_server(tmp_path):
    from infer.bench import serving
    from tests.server.conftest import ServerProcess

    folder = build_embedder(tmp_path / "model", "bert")
    server = ServerProcess(["--model", str(folder)], tmp_path / "server.log").start()
    try:
        argv = ["--server", server.url, "--workload", "embeddings,rerank", "--input-tokens", "16,40",
                "--batch-sizes", "1,3", "--scale", "small", "--report-dir", str(tmp_path / "reports"),
                "--no-progress"]  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = serving.main(argv)
    finally:
        server.stop()
    assert rc == 0, err.getvalue()
    assert "pooling workloads" in out.getvalue() and "note:" not in out.getvalue()
    (path,) = (tmp_path / "reports").glob("serving-*.json")
    report = json.loads(path.read_text())
    assert report["kind"] == "serving" and path.with_suffix(".html").is_file()
    assert [r["name"] for r in report["pooling_workloads"]] == ["embeddings", "rerank"]
    for r in report["pooling_workloads"]:
        assert [(x["tokens"], x["batch"]) for x in r["results"]] == [(16, 1), (16, 3), (40, 1), (40, 3)]
        assert all(x["summary"]["num_ok"] == 2 and x["summary"]["docs_per_s"] > 0 for x in r["results"])
    rows = report["tables"][0]["rows"]
    assert len(rows) == 8 and {row[0] for row in rows} == {"embeddings", "rerank"}


def test_pooling_and_generation_workloads_do_not_mix():
    from infer.bench import serving

    parser = race.argparse.ArgumentParser()
    serving.add_arguments(parser)
    with pytest.raises(ValueError, match="without the others"):
        serving.run(parser.parse_args(["--workload", "embeddings,baseline"]), [], io.StringIO())
