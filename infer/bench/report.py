"""What a report records besides the numbers (machine, versions, the server), and terminal tables."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import httpx


def machine_info() -> dict:
    """Host, CPU, Python and package versions, so a result can be reproduced."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for pkg in ("infer", "httpx", "numpy", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


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


def server_info(base_url: str, card: dict, server_flags: str | None, api_key: str | None = None) -> dict:
    """What is known of the server: its model card, whether it is ours, and its flags: from the user
    (--server-flags), else from GET /server_info where the server has it (vLLM's dev route; behind the
    API key on ours), else unknown."""
    flags = server_flags
    if flags is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            resp = httpx.get(base_url.rstrip("/") + "/server_info", headers=headers, timeout=5)
            flags = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            flags = None
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


def render_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain aligned table: first column left, the rest right."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])]
    return "\n".join(out)


def write_report(path: Path, report: dict, out) -> dict:
    """Write a benchmark's JSON report (its folder made as needed), say where on `out`; the report gains
    its "path"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    report["path"] = str(path)
    print(f"\nreport: {path}", file=out)
    return report
