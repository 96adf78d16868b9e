"""PNG plots of a traffic experiment (matplotlib, headless). Failed requests are drawn, never dropped:
a request that did not complete has no completion count, so it is placed at the tokens it asked for."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from infer.bench.metrics import RequestRecord  # noqa: E402

FATE_COLORS = {"ok": "tab:green", "error": "tab:red", "timeout": "tab:orange", "aborted": "tab:gray"}


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def token_heatmap(records: list[RequestRecord], path: Path) -> None:
    """Prompt x completion tokens: completed requests as a 2-D histogram, failed ones as crosses at
    (their prompt estimate, the tokens they asked for)."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ok = [r for r in records if r.ok and r.num_prompt_tokens is not None]
    if ok:
        h = ax.hist2d(
            [r.num_prompt_tokens for r in ok], [r.num_completion_tokens or 0 for r in ok], bins=20, cmin=1
        )
        fig.colorbar(h[3], ax=ax, label="completed requests")
    failed = [r for r in records if not r.ok]
    if failed:
        ax.scatter(
            [r.num_prompt_tokens or r.target_prompt_tokens or 0 for r in failed],
            [r.max_tokens or 0 for r in failed],
            marker="x", color="tab:red", label=f"not completed ({len(failed)})",
        )  # fmt: skip
        ax.legend(loc="upper right")
    ax.set(xlabel="prompt tokens", ylabel="completion tokens (asked, if failed)")
    ax.set_title(f"{len(records)} requests: {len(ok)} completed, {len(failed)} not")
    _save(fig, path)


def fate_by_input_length(records: list[RequestRecord], path: Path, num_bins: int = 8) -> None:
    """Stacked counts of ok / error / timeout / aborted per prompt-length bin."""
    lengths = [r.num_prompt_tokens or r.target_prompt_tokens or 0 for r in records]
    lo, hi = (min(lengths), max(lengths)) if lengths else (0, 1)
    width = max(1, -(-(hi - lo + 1) // num_bins))
    edges = [lo + i * width for i in range(num_bins)]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0] * num_bins
    for fate, color in FATE_COLORS.items():
        counts = [0] * num_bins
        for r, n in zip(records, lengths, strict=True):
            if r.status == fate:
                counts[min(num_bins - 1, (n - lo) // width)] += 1
        if any(counts):
            ax.bar(edges, counts, width=width * 0.9, bottom=bottom, color=color, label=fate, align="edge")
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set(xlabel="prompt tokens", ylabel="requests", title="request fate by input length")
    ax.legend()
    _save(fig, path)


def latency_per_class(summary: dict, path: Path) -> None:
    """TTFT and end-to-end latency P50 / P95 / P99 per class (stable window), log scale."""
    classes = list(summary["per_class"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "latency_ms", "end-to-end latency")):
        for j, q in enumerate(("p50", "p95", "p99")):
            values = [summary["per_class"][c][key][q] or 0 for c in classes]
            ax.bar([i + 0.27 * (j - 1) for i in range(len(classes))], values, width=0.25, label=q)
        ax.set_xticks(range(len(classes)), classes)
        ax.set(ylabel="ms", title=f"{title} (from intended send)")
        if any(summary["per_class"][c][key]["max"] for c in classes):
            ax.set_yscale("log")
        ax.legend()
    _save(fig, path)


def timeline(summary: dict, path: Path) -> None:
    """The server's /metrics during the run: KV usage, running / waiting requests, prefix hit rate."""
    samples = summary["timeline"]
    fig, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    t = [s["t"] for s in samples]

    def series(name):
        return [s.get(f"infer:{name}", s.get(f"vllm:{name}", 0.0)) for s in samples]

    axes[0].plot(t, [100 * v for v in series("kv_cache_usage_perc")])
    axes[0].set(ylabel="KV usage %")
    axes[1].plot(t, series("num_requests_running"), label="running")
    axes[1].plot(t, series("num_requests_waiting"), label="waiting")
    axes[1].set(ylabel="requests")
    axes[1].legend()
    hits, queries = series("prefix_cache_hits_total"), series("prefix_cache_queries_total")
    rate = [0.0] + [
        100 * (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        for h0, h1, q0, q1 in zip(hits, hits[1:], queries, queries[1:], strict=False)
    ]
    axes[2].plot(t, rate[: len(t)])
    axes[2].set(ylabel="prefix hit %", xlabel="seconds since start")
    axes[0].set_title("server timeline" if samples else "server timeline (no /metrics)")
    _save(fig, path)


def throughput_vs_goodput(summary: dict, path: Path) -> None:
    st, g = summary["stable"]["throughput"], summary["goodput"]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(["throughput", "goodput"], [st["output_tokens_per_s"], g["goodput_tokens_per_s"]],
           color=["tab:blue", "tab:green"])  # fmt: skip
    ax.set(ylabel="output tokens/s", title="throughput vs goodput (stable window)")
    _save(fig, path)


def experiment_plots(records: list[RequestRecord], summary: dict, out_dir: Path) -> list[Path]:
    paths = [out_dir / n for n in ("heatmap.png", "fate.png", "latency.png", "timeline.png", "goodput.png")]
    token_heatmap(records, paths[0])
    fate_by_input_length(records, paths[1])
    latency_per_class(summary, paths[2])
    timeline(summary, paths[3])
    throughput_vs_goodput(summary, paths[4])
    return paths


def tradeoff_plot(classes: list[str], names: list[str], matrix: list[list], path: Path) -> None:
    """SLO compliance, class x experiment, as a colored grid with the percentages written in."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(names), 1.2 + 0.6 * len(classes)))
    data = [[float("nan") if v is None else 100 * v for v in row] for row in matrix]
    im = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v != v else f"{v:.0f}%", ha="center", va="center")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    fig.colorbar(im, ax=ax, label="SLO compliance %")
    ax.set_title("tradeoff matrix")
    _save(fig, path)


PHASE_COLORS = {"queued": "tab:gray", "prefill": "tab:blue", "decode": "tab:green", "preempted": "tab:red"}


def request_gantt(timelines: list, path: Path) -> int:
    """Each request's fate from the engine trace: one row per request (arrival order, top down), a bar
    per queued / prefill chunk / decode / preempted slice; hatched where still open at the trace's end.
    Returns the number of bars drawn."""
    fig, ax = plt.subplots(figsize=(9, min(12.0, 1.5 + 0.22 * max(1, len(timelines)))))
    t0 = min((t.start_us for t in timelines), default=0.0)
    num_bars = 0
    for row, t in enumerate(timelines):
        for phase, color in PHASE_COLORS.items():
            spans = [((s.start_us - t0) / 1e3, (s.end_us - s.start_us) / 1e3) for s in t.segments
                     if s.phase == phase]  # fmt: skip
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
                num_bars += len(spans)
        for s in t.segments:
            if s.open:
                ax.broken_barh([((s.start_us - t0) / 1e3, (s.end_us - s.start_us) / 1e3)], (row - 0.4, 0.8),
                               facecolors="none", hatch="//", edgecolor="black", linewidth=0)  # fmt: skip
    ax.set_yticks(range(len(timelines)), [t.req_id for t in timelines], fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="ms since the first arrival in the trace", title=f"request fate: {len(timelines)} requests")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    ax.legend(handles, list(PHASE_COLORS), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    _save(fig, path)
    return num_bars


def trace_counters(series: dict, path: Path) -> None:
    """The trace's counter tracks over time, one panel per counter (requests, kv_blocks, tokens)."""
    names = list(series)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.2 + 1.8 * len(names)), sharex=True, squeeze=False)
    t0 = min(ts for tracks in series.values() for points in tracks.values() for ts, _ in points)
    for ax, name in zip(axes[:, 0], names, strict=True):
        for key, points in series[name].items():
            ax.step([(ts - t0) / 1e6 for ts, _ in points], [v for _, v in points], where="post", label=key)
        ax.set(ylabel=name)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set(xlabel="seconds since the trace's first step")
    axes[0, 0].set_title("engine counters (from the trace)")
    _save(fig, path)


def client_batches(batches: list[dict], path: Path) -> None:
    """`bench client`'s batches: tokens/s and average TTFT per batch size, sequential vs concurrent."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for mode, marker in (("sequential", "o"), ("concurrent", "s")):
        rows = [b for b in batches if b["mode"] == mode]
        sizes = [b["batch_size"] for b in rows]
        axes[0].plot(sizes, [b["tokens_per_s"] or 0 for b in rows], marker=marker, label=mode)
        axes[1].plot(sizes, [b["avg_ttft_ms"] or 0 for b in rows], marker=marker, label=mode)
    axes[0].set(xlabel="batch size", ylabel="output tokens/s", title="throughput")
    axes[1].set(xlabel="batch size", ylabel="ms", title="average TTFT")
    for ax in axes:
        ax.legend()
    _save(fig, path)
