"""What a record holds of the server (its card, flags, metrics), and tables as the terminal shows them."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import httpx

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


def scrape_metrics(base_url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The server's Prometheus scalars (`infer:*` or `vllm:*`, histogram buckets left out), summed over
    labels; None when the server has no /metrics."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m["name"].startswith(("infer:", "vllm:")) or m["name"].endswith("_bucket"):
            continue
        try:
            out[m["name"]] = out.get(m["name"], 0.0) + float(m["value"])
        except ValueError:
            continue
    return out


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters' growth over a workload (gauges as their final value)."""
    if before is None or after is None:
        return None
    return {
        k: v - before.get(k, 0.0) if k.endswith(("_total", "_sum", "_count")) else v for k, v in after.items()
    }


def fetch_server_info(base_url: str, api_key: str | None = None) -> dict | None:
    """GET /server_info (vLLM's dev route; behind the API key on ours), or None where there is none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/server_info", headers=headers, timeout=10)
        info = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def server_info(base_url: str, card: dict, server_flags: str | None, api_key: str | None = None) -> dict:
    """What is known of the server: its model card, whether it is ours, and its flags: from the user
    (--server-flags), else from GET /server_info where the server has it (vLLM's dev route; behind the
    API key on ours), else unknown."""
    flags = server_flags if server_flags is not None else fetch_server_info(base_url, api_key)
    return {
        "url": base_url,
        "is_infer": card.get("owned_by") == "infer",
        "model_card": card,
        "max_model_len": card.get("max_model_len"),
        "flags": flags
        if flags is not None
        else "unknown (the server does not report them; pass --server-flags)",
    }


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr when tqdm is installed, wanted and stderr is a terminal; else a no-op."""
    if enabled and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)
        except ImportError:
            pass

    class _Null:
        def update(self, n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None, bars: bool = False
) -> str:
    """A plain aligned table: first column left, the rest right; with `bars`, every column left and
    separated by ` | ` under a `-+-` rule (the micro-benchmarks' tables, as the runs they compare with
    print them)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    sep, rule = (" | ", "-+-") if bars else ("  ", "  ")

    def line(row):
        padded = (
            c.ljust(w) if i == 0 or bars else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        return sep.join(padded).rstrip() if bars else sep.join(padded)

    out = [title] if title else []
    out += [line(cells[0]), rule.join("-" * w for w in widths), *(line(r) for r in cells[1:])]
    return "\n".join(out)


def render_tables(tables: Sequence[dict]) -> str:
    """A record's tables (infer.bench.record.table), as the command prints them."""
    return "\n\n".join(render_table(t["headers"], t["rows"], t.get("title")) for t in tables)
