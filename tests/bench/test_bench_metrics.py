"""The serving metrics and arrival processes on synthetic timestamps: no server, no clock."""

from __future__ import annotations

import numpy as np
import pytest

from infer.bench.arrivals import Arrivals, constant_times, poisson_times
from infer.bench.metrics import (
    SLO,
    RequestRecord,
    dispatch_delay,
    distribution,
    goodput,
    itls,
    latency,
    meets_slo,
    percentile,
    stable_window,
    summarize,
    throughput,
    tpot,
    ttft,
)


def rec(req_id=0, intended=0.0, sent=None, first=None, chunks=(), end=None, status="ok", n_out=None, **kw):
    sent = intended if sent is None else sent
    return RequestRecord(
        req_id=req_id,
        intended_send=intended,
        sent=sent,
        first_token=first,
        chunk_times=list(chunks),
        end=end,
        status=status,
        num_completion_tokens=n_out,
        **kw,
    )


# ---- percentiles -------------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 1, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_percentile_small_cases():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0  # order of input does not matter
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_distribution_empty_and_full():
    d = distribution([])
    assert d["count"] == 0 and d["p50"] is None and d["mean"] is None
    d = distribution([1.0, 2.0, 3.0])
    assert d["count"] == 3 and d["mean"] == 2.0 and d["p50"] == 2.0 and d["min"] == 1.0 and d["max"] == 3.0


# ---- one request -------------------------------------------------------------------------------------


def test_ttft_itl_latency_from_timestamps():
    r = rec(intended=1.0, sent=1.5, first=2.0, chunks=[2.0, 2.1, 2.3, 2.6], end=2.7, n_out=4)
    assert dispatch_delay(r) == pytest.approx(0.5)
    assert ttft(r) == pytest.approx(1.0)  # from the intended send
    assert ttft(r, from_intended=False) == pytest.approx(0.5)  # from the actual send
    assert latency(r) == pytest.approx(1.7)
    assert latency(r, from_intended=False) == pytest.approx(1.2)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot(r) == pytest.approx(0.7 / 3)


def test_tpot_uses_usage_not_chunks():
    # two chunks, but the server says 5 tokens: one chunk carried several
    r = rec(first=1.0, chunks=[1.0, 2.0], end=2.0, n_out=5)
    assert tpot(r) == pytest.approx(0.25)
    assert tpot(rec(first=1.0, chunks=[1.0], end=1.0, n_out=1)) is None


def test_missing_events_give_none():
    r = rec(status="error", end=0.2)
    assert ttft(r) is None and tpot(r) is None and itls(r) == []
    assert dispatch_delay(RequestRecord(req_id=0, intended_send=0.0)) is None


# ---- coordinated omission ----------------------------------------------------------------------------


def test_coordinated_omission_correction():
    """A client capped at 1 in flight sends 4 requests intended every 0.1 s, each served in 1 s: the k-th
    leaves k seconds late. Measured from the actual send every request looks like 1 s; from the intended
    send the queueing the user saw is there, and the dispatch delay says where it came from."""
    records = []
    for k in range(4):
        intended, sent = 0.1 * k, 1.0 * k
        records.append(rec(k, intended, sent, first=sent + 0.5, chunks=[sent + 0.5], end=sent + 1.0, n_out=1))
    s = summarize(records)
    assert s["ttft_from_send_ms"]["p99"] == pytest.approx(500)
    assert s["ttft_ms"]["max"] == pytest.approx(500 + 3 * 900)
    assert s["latency_ms"]["p50"] > 1000
    assert [dispatch_delay(r) for r in records] == pytest.approx([0.0, 0.9, 1.8, 2.7])
    assert s["dispatch_delay_ms"]["max"] == pytest.approx(2700)


# ---- throughput and goodput --------------------------------------------------------------------------


def test_throughput_counts_only_successes_and_usage_tokens():
    records = [
        rec(0, 0.0, first=0.1, chunks=[0.1], end=1.0, n_out=10, num_prompt_tokens=5),
        rec(1, 0.5, first=0.6, chunks=[0.6], end=2.0, n_out=30, num_prompt_tokens=5),
        rec(2, 1.0, end=1.1, status="error", n_out=None),
    ]
    t = throughput(records)
    assert t["duration_s"] == pytest.approx(2.0)
    assert t["output_tokens_per_s"] == pytest.approx(20.0)
    assert t["requests_per_s"] == pytest.approx(1.0)
    assert t["total_tokens_per_s"] == pytest.approx(25.0)
    assert throughput([])["output_tokens_per_s"] == 0.0


def test_meets_slo_each_bound():
    r = rec(first=0.2, chunks=[0.2, 0.25, 0.3, 0.5], end=0.5, n_out=4)
    assert meets_slo(r, SLO())
    assert meets_slo(r, SLO(ttft=0.2)) and not meets_slo(r, SLO(ttft=0.19))
    assert meets_slo(r, SLO(itl_p95=0.2)) and not meets_slo(r, SLO(itl_p95=0.1))
    assert meets_slo(r, SLO(e2e=0.5)) and not meets_slo(r, SLO(e2e=0.4))
    assert not meets_slo(rec(status="timeout", end=9.0), SLO())


def test_slo_from_ms_and_validation():
    assert SLO.from_ms({"ttft_ms": 500, "e2e_ms": 2000}) == SLO(ttft=0.5, e2e=2.0)
    with pytest.raises(ValueError, match="unknown SLO keys"):
        SLO.from_ms({"ttft": 1})
    with pytest.raises(ValueError, match="> 0"):
        SLO(ttft=0)


def test_goodput_differs_from_throughput():
    """Four short requests meet a 1 s TTFT objective, two long ones miss it, one fails: goodput counts
    only what met the objective, per class, while throughput counts everything that succeeded."""
    short = [rec(i, 0.0, first=0.5, chunks=[0.5], end=1.0, n_out=10, req_class="siso") for i in range(4)]
    long = [rec(10 + i, 0.0, first=3.0, chunks=[3.0], end=4.0, n_out=100, req_class="lilo") for i in range(2)]
    failed = [rec(20, 0.0, end=0.1, status="error", req_class="lilo")]
    records = short + long + failed
    slos = {"siso": SLO(ttft=1.0), "lilo": SLO(ttft=1.0)}
    g = goodput(records, slos)
    assert g["num_good"] == 4
    assert g["goodput_tokens_per_s"] == pytest.approx(40 / 4.0)
    assert throughput(records)["output_tokens_per_s"] == pytest.approx(240 / 4.0)
    assert g["per_class"]["siso"] == {"num_requests": 4, "num_good": 4, "compliance": 1.0}
    assert g["per_class"]["lilo"]["compliance"] == 0.0 and g["per_class"]["lilo"]["num_requests"] == 3
    # a class without an SLO: every success is good
    assert goodput(records, {})["num_good"] == 6


# ---- stable window -----------------------------------------------------------------------------------


def test_stable_window_drops_warmup_and_cooldown():
    records = [rec(i, float(i), end=i + 0.5) for i in range(10)]  # intended sends at 0..9 s
    w = stable_window(records, warmup_s=2.0, cooldown_s=3.0)
    assert [r.req_id for r in w.records] == [2, 3, 4, 5, 6]
    assert (w.num_dropped_warmup, w.num_dropped_cooldown) == (2, 3)
    assert w.to_dict()["num_kept"] == 5
    assert len(stable_window(records).records) == 10
    assert stable_window([]).records == []
    with pytest.raises(ValueError):
        stable_window(records, warmup_s=-1)


def test_stable_window_larger_than_run_keeps_nothing():
    records = [rec(i, float(i), end=i + 0.5) for i in range(3)]
    w = stable_window(records, warmup_s=5.0, cooldown_s=5.0)
    assert w.records == [] and w.num_dropped_warmup + w.num_dropped_cooldown == 3


def test_summarize_counts_every_status():
    records = [
        rec(0, first=0.1, chunks=[0.1, 0.2], end=0.2, n_out=2),
        rec(1, status="error", end=0.1, http_status=500),
        rec(2, status="timeout", end=5.0),
        rec(3, status="aborted", end=1.0),
    ]
    s = summarize(records)
    assert s["num_requests"] == 4 and s["num_ok"] == 1 and s["num_errors"] == 3
    assert s["status_counts"] == {"ok": 1, "error": 1, "timeout": 1, "aborted": 1}
    assert s["ttft_ms"]["count"] == 1 and s["itl_ms"]["p50"] == pytest.approx(100)


# ---- arrivals ----------------------------------------------------------------------------------------


def test_constant_times():
    assert constant_times(4, 2.0) == pytest.approx([0.0, 0.5, 1.0, 1.5])
    with pytest.raises(ValueError, match="rate"):
        constant_times(3, 0.0)


def test_poisson_rate_and_seed():
    times = poisson_times(20_000, 5.0, seed=42)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)  # mean gap 1/rate
    assert gaps.std() == pytest.approx(1 / 5.0, rel=0.05)  # exponential: std == mean
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert poisson_times(50, 5.0, seed=42) == poisson_times(50, 5.0, seed=42)
    assert poisson_times(50, 5.0, seed=42) != poisson_times(50, 5.0, seed=43)
    assert poisson_times(0, 5.0, seed=1) == []


def test_arrivals_modes():
    assert Arrivals("burst").schedule(3) == [0.0, 0.0, 0.0]
    assert Arrivals("poisson", rate=2.0, seed=7).schedule(5) == poisson_times(5, 2.0, 7)
    a = Arrivals.parse("concurrent:8")
    assert a.closed_loop and a.num_workers == 8 and a.describe() == "concurrent(8)"
    assert Arrivals.parse("synchronous").num_workers == 1
    assert Arrivals.parse("constant:4").schedule(2) == [0.0, 0.25]
    with pytest.raises(ValueError, match="closed loop"):
        a.schedule(3)
    with pytest.raises(ValueError, match="unknown arrival mode"):
        Arrivals("uniform")
    with pytest.raises(ValueError, match="needs a rate"):
        Arrivals.parse("poisson")
