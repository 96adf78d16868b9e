"""Each request's life, read back from the engine trace (infer.engine.trace): each
request's fate as data, for the HTML report's Gantt and table.

The trace holds one async track per request (`cat` "request", `id` the request id): an outer b/e slice
named by the request id (arrival -> end; end args: finish_reason and token counts), holding in turn
`queued`, one `prefill` per chunk, `decode`, and `preempted` (then re-queued as prefill chunks):

    req-7  |==================================================================| finish_reason=length
           |queued    |prefill|prefill|decode...................|preempted|prefill|decode.....|

`request_timelines` pairs each `b` with its `e` (a stack per request, since the slices nest) and returns
one RequestTimeline per request, ordered by arrival. A slice still open when the trace was written (a
request in flight at shutdown) ends at the trace's last timestamp and is marked `open`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("queued", "prefill", "decode", "preempted")


@dataclass
class Segment:
    phase: str  # one of PHASES
    start_us: float
    end_us: float
    open: bool = False  # not ended in the trace: cut at its last timestamp
    args: dict = field(default_factory=dict)  # the b args merged with the e args


@dataclass
class RequestTimeline:
    req_id: str
    start_us: float
    end_us: float
    segments: list[Segment]
    end_args: dict  # finish_reason, prompt/cached/output tokens, preemptions (empty when still open)

    def total_us(self, phase: str) -> float:
        return sum(s.end_us - s.start_us for s in self.segments if s.phase == phase)

    def count(self, phase: str) -> int:
        return sum(s.phase == phase for s in self.segments)


def load_trace(path: str | Path) -> list[dict]:
    """The trace's events: a `{"traceEvents": [...]}` object or a bare list (both are Chrome's format)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the trace {path}: {exc}") from exc
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    return events


def request_timelines(events: list[dict]) -> list[RequestTimeline]:
    """Pair the request tracks' b/e events into one RequestTimeline per request, by arrival."""
    async_events = [e for e in events if e.get("ph") in ("b", "e") and e.get("cat") == "request"]
    if not async_events:
        return []
    last_us = max(e["ts"] for e in events if "ts" in e)
    stacks: dict[str, list[dict]] = {}
    out: dict[str, RequestTimeline] = {}
    for e in sorted(async_events, key=lambda e: e["ts"]):  # stable: b before e at equal times as written
        req_id = str(e["id"])
        stack = stacks.setdefault(req_id, [])
        if e["ph"] == "b":
            stack.append(e)
            if e["name"] == req_id:
                out[req_id] = RequestTimeline(req_id, e["ts"], last_us, [], {})
            continue
        begin = _pop(stack, e["name"])
        if begin is None:
            continue  # an e without its b: the trace module never writes one (it re-begins orphans)
        if e["name"] == req_id:
            if req_id in out:
                out[req_id].end_us = e["ts"]
                out[req_id].end_args = dict(e.get("args") or {})
        elif e["name"] in PHASES:
            args = {**(begin.get("args") or {}), **(e.get("args") or {})}
            _timeline(out, req_id, begin["ts"]).segments.append(
                Segment(e["name"], begin["ts"], e["ts"], False, args)
            )
    for req_id, stack in stacks.items():  # still open at the end of the trace
        for begin in stack:
            if begin["name"] in PHASES:
                args = dict(begin.get("args") or {})
                segment = Segment(begin["name"], begin["ts"], last_us, True, args)
                _timeline(out, req_id, begin["ts"]).segments.append(segment)
    for t in out.values():
        t.segments.sort(key=lambda s: s.start_us)
    return sorted(out.values(), key=lambda t: (t.start_us, t.req_id))


def _pop(stack: list[dict], name: str) -> dict | None:
    """The innermost open slice named `name` (slices of one request nest, so normally the top)."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i]["name"] == name:
            return stack.pop(i)
    return None


def _timeline(out: dict[str, RequestTimeline], req_id: str, ts: float) -> RequestTimeline:
    if req_id not in out:  # its outer slice is not in the trace: begin it at its first phase
        out[req_id] = RequestTimeline(req_id, ts, ts, [], {})
    t = out[req_id]
    t.start_us = min(t.start_us, ts)
    return t


def counter_series(events: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """The counter tracks (`ph` C): {counter name: {arg: [(ts_us, value), ...]}}, in time order."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for e in sorted((e for e in events if e.get("ph") == "C"), key=lambda e: e["ts"]):
        for key, value in (e.get("args") or {}).items():
            out.setdefault(e["name"], {}).setdefault(key, []).append((e["ts"], value))
    return out


def timeline_rows(timelines: list[RequestTimeline]) -> list[list]:
    """One table row per request: the numbers behind the Gantt (times in ms)."""
    rows = []
    for t in timelines:
        a = t.end_args
        rows.append([
            t.req_id, t.start_us / 1e3, t.total_us("queued") / 1e3, t.count("prefill"),
            t.total_us("prefill") / 1e3, t.total_us("decode") / 1e3, t.count("preempted"),
            (t.end_us - t.start_us) / 1e3, a.get("finish_reason") or ("(open)" if not a else "-"),
            a.get("prompt_tokens"), a.get("cached_tokens"), a.get("output_tokens"),
        ])  # fmt: skip
    return rows


TIMELINE_HEADERS = [
    "Request", "Arrival ms", "Queued ms", "Chunks", "Prefill ms", "Decode ms", "Preempted", "Total ms",
    "Finish", "Prompt", "Cached", "Output",
]  # fmt: skip
