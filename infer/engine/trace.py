"""The engine trace: what each step did and where each request was, in the Chrome trace-event JSON format
that Perfetto UI (ui.perfetto.dev) and chrome://tracing open unchanged.

Aggregates (Prometheus, p50/p99) say that requests waited, not why; this says which steps a request was
in, beside whom, when it was chunked or preempted. On only with `EngineConfig.trace_path` (`--trace FILE`):
the engine then calls `record_step` once per step and `record_added` / `record_ended` on arrivals and
aborts, and otherwise never touches this module. The file is written by `LLMEngine.close()` (server
shutdown, `LLM.close()`) or on demand with `write(path)`; the server's `GET /debug/trace?seconds=S` serves
`events(since_us)` from the same ring.

The events (`ts` and `dur` in microseconds since the trace began, `pid` 1, `tid` 1):

    X  step                 one per engine step; args: step, requests, prefill_tokens, decode_tokens,
                            preemptions, evictions, prefix_hit_tokens (admissions' cached tokens),
                            budget_used (prefill + decode tokens) of budget (max_num_batched_tokens)
    X  schedule | prepare | forward | update | detokenize     its phases, nested in it (the engine's
                            StepTiming: forward includes logits and sampling, update is the scheduler's,
                            detokenize the text and stop strings)
    i  preempt              on the step track, args req_id
    C  requests {running, waiting}, kv_blocks {used, cached, free}, tokens {prefill, decode}: after
                            scheduling (the step's StepStats), one counter track per arg in Perfetto
    b/e  one async track per request (`id` = request id, cat "request"): an outer slice named by the
         request id from arrival to its end (end args: finish_reason, prompt/cached/output tokens,
         preemptions), holding in turn
           queued           arrival -> admission (end args: cached_tokens, the prefix hit)
           prefill          one per chunk, over its step (args: start, tokens)
           decode           first decode step -> end or preemption
           preempted        preemption -> re-admission (recompute follows as prefill chunks)

Bounded: a ring (collections.deque with maxlen) of the last `max_steps` steps' events, with the arrivals
and aborts between two steps kept with the step after them. A request whose beginning fell out of the ring
(or out of a `since_us` window) gets its open slices re-begun at the window's start, so every `e` has its
`b`. Thread-safe: the engine thread appends under a lock and readers copy the ring under it, so the server
reads while the engine runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

PID, TID = 1, 1  # one process, one thread track for the steps; requests are async tracks (by id)


class StepTrace:
    """A bounded ring of the last `max_steps` engine steps' trace events (a deque with maxlen).

    The engine thread stores each step as one tuple of raw clock readings and its StepStats, with a tuple
    per request transition (none in a steady decode step); the event dicts are built only when read.
    Recording a step then costs a few microseconds, and the ring holds few objects for the garbage
    collector to walk (10,000 decode steps: ~5 MB)."""

    def __init__(
        self,
        max_steps: int = 10_000,
        clock: Callable[[], float] = time.perf_counter,
        budget: int | None = None,
    ):
        self.clock = clock  # the engine's step timer, so that recorded times and step times agree
        self.budget = budget  # max_num_batched_tokens, shown beside each step's tokens
        self.origin = clock()
        self.max_steps = max_steps
        self._ring: deque[tuple] = deque(maxlen=max_steps)  # (step record, its request events)
        self._pending: list[tuple] = []  # request events (arrivals, aborts) since the last step
        self._lock = threading.Lock()
        self._phase: dict[str, str] = {}  # unfinished req_id -> its open inner slice ("" = none)
        self._num_steps = 0

    def us(self, t: float) -> float:
        """A clock() reading as microseconds since the trace began."""
        return round((t - self.origin) * 1e6, 3)

    def now_us(self) -> float:
        return self.us(self.clock())

    # -- recording, on the engine thread ---------------------------------------------------------------
    # A request event is (ph, name, req_id, clock() time, args or None).

    def record_added(self, req_id: str, num_prompt_tokens: int, priority: int) -> None:
        t = self.clock()
        self._phase[req_id] = "queued"
        args = {"prompt_tokens": num_prompt_tokens, "priority": priority}
        with self._lock:
            self._pending += [("b", req_id, req_id, t, args), ("b", "queued", req_id, t, None)]

    def record_ended(self, outputs: Iterable) -> None:
        """Requests ended between steps (aborts): StepOutputs with finished set."""
        t = self.clock()
        events = [e for out in outputs if out.finished for e in self._end(out, t)]
        with self._lock:
            self._pending += events

    def record_step(self, start: float, timing, sched, outputs: list) -> None:
        """One step: `start` its clock() reading, `timing` its StepTiming, `sched` its SchedulerOutput,
        `outputs` its StepOutputs."""
        t_sched = start + timing.schedule_s
        t_prep = t_sched + timing.prepare_s
        t_fwd = t_prep + timing.forward_s
        t_upd = t_fwd + timing.update_s
        t_end = t_upd + timing.detokenize_s
        phase, events, num_hit = self._phase, [], 0
        for req_id in sched.preempted_req_ids:
            events.append(("i", "preempt", req_id, start, None))
            events += self._close(req_id, start, {"preempted": True})
            events.append(("b", "preempted", req_id, start, None))
            phase[req_id] = "preempted"
        for s in sched.scheduled:
            open_phase = phase.get(s.req_id)
            if open_phase == "decode":  # the steady state: nothing to record
                continue
            if open_phase in ("queued", "preempted"):  # admitted in this step
                num_hit += s.start_pos
                events += self._close(s.req_id, start, {"cached_tokens": s.start_pos})
            if s.sample and s.num_tokens == 1 and s.start_pos >= s.num_prompt_tokens:  # its first decode
                events += self._close(s.req_id, start)
                events.append(("b", "decode", s.req_id, start, None))
                phase[s.req_id] = "decode"
            else:  # a prefill chunk (or recomputation after a preemption), over its step
                events += self._close(s.req_id, start)
                events.append(
                    ("b", "prefill", s.req_id, start, {"start": s.start_pos, "tokens": s.num_tokens})
                )
                events.append(("e", "prefill", s.req_id, t_end, None))
        for out in outputs:
            if out.finished:
                events += self._end(out, t_end)
        stats = sched.stats  # a fresh StepStats each step: kept as it is
        times = (start, t_sched, t_prep, t_fwd, t_upd, t_end)
        record = (times, self._num_steps, len(sched.scheduled), num_hit, stats)
        self._num_steps += 1
        with self._lock:
            self._ring.append((record, self._pending + events if self._pending else events))
            self._pending = []

    def _close(self, req_id: str, t: float, args: dict | None = None) -> list[tuple]:
        """End req_id's open inner slice, if any."""
        name = self._phase.get(req_id)
        if not name:
            return []
        self._phase[req_id] = ""
        return [("e", name, req_id, t, args)]

    def _end(self, out, t: float) -> list[tuple]:
        if out.req_id not in self._phase:  # added before tracing began, or already ended
            return []
        events = self._close(out.req_id, t)
        del self._phase[out.req_id]
        req = out.request
        args = {
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "output_tokens": out.num_output_tokens,
            "preemptions": req.num_preemptions if req is not None else None,
        }
        return [*events, ("e", out.req_id, out.req_id, t, args)]

    # -- reading, from any thread ----------------------------------------------------------------------

    def events(self, since_us: float | None = None) -> list[dict]:
        """The ring's events (of the steps that began at or after since_us, with what came between them),
        every async `e` with its `b`, after the metadata events that name the tracks."""
        with self._lock:
            entries = list(self._ring)
            pending = list(self._pending)
        events = []
        for record, request_events in entries:
            if since_us is None or self.us(record[0][0]) >= since_us:
                events += self._step_events(record)
                events += [self._request_event(*e) for e in request_events]
        events += [self._request_event(*e) for e in pending]
        return _metadata() + _rebegin_orphans(events)

    def _step_events(self, record: tuple) -> list[dict]:
        times, step, num_scheduled, num_hit, stats = record
        t0, t_sched, t_prep, t_fwd, t_upd, t_end = (self.us(t) for t in times)
        s = stats
        args = {"step": step, "requests": num_scheduled, "prefill_tokens": s.num_prefill_tokens,
                "decode_tokens": s.num_decode_tokens, "preemptions": s.num_preemptions,
                "evictions": s.num_evictions, "prefix_hit_tokens": num_hit,
                "budget_used": s.num_prefill_tokens + s.num_decode_tokens}  # fmt: skip
        if self.budget is not None:
            args["budget"] = self.budget
        return [
            _slice("step", t0, t_end, args),
            _slice("schedule", t0, t_sched),
            _slice("prepare", t_sched, t_prep),
            _slice("forward", t_prep, t_fwd),
            _slice("update", t_fwd, t_upd),
            _slice("detokenize", t_upd, t_end),
            _counter("requests", t_sched, running=s.num_running, waiting=s.num_waiting),
            _counter(
                "kv_blocks",
                t_sched,
                used=s.num_blocks_used,
                cached=s.num_blocks_cached,
                free=s.num_blocks_free,
            ),  # fmt: skip
            _counter("tokens", t_sched, prefill=s.num_prefill_tokens, decode=s.num_decode_tokens),
        ]

    def _request_event(self, ph: str, name: str, req_id: str, t: float, args: dict | None) -> dict:
        if ph == "i":
            return {"name": name, "ph": "i", "s": "t", "ts": self.us(t), "pid": PID, "tid": TID,
                    "args": {"req_id": req_id}}  # fmt: skip
        return _async(ph, name, req_id, self.us(t), args)

    def dumps(self, since_us: float | None = None) -> str:
        return json.dumps({"traceEvents": self.events(since_us), "displayTimeUnit": "ms"})

    def write(self, path: str | os.PathLike) -> None:
        """Write the trace to path (whole: through a temporary file, so a reader never sees half)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.dumps())
        os.replace(tmp, path)


def _slice(name: str, start: float, end: float, args: dict | None = None) -> dict:
    event = {"name": name, "cat": "step", "ph": "X", "ts": start, "dur": round(end - start, 3),
             "pid": PID, "tid": TID}  # fmt: skip
    if args is not None:
        event["args"] = args
    return event


def _counter(name: str, ts: float, **values: int) -> dict:
    return {"name": name, "ph": "C", "ts": ts, "pid": PID, "tid": TID, "args": values}


def _async(ph: str, name: str, req_id: str, ts: float, args: dict | None = None) -> dict:
    event = {"name": name, "cat": "request", "ph": ph, "id": req_id, "ts": ts, "pid": PID, "tid": TID}
    if args is not None:
        event["args"] = args
    return event


def _metadata() -> list[dict]:
    return [
        {
            "name": "process_name",
            "ph": "M",
            "ts": 0,
            "pid": PID,
            "tid": TID,
            "args": {"name": "infer engine"},
        },
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": TID, "args": {"name": "engine steps"}},
    ]


def _rebegin_orphans(events: list[dict]) -> list[dict]:
    """Give every async `e` whose `b` is not in events (it fell out of the ring or the window) a `b` at the
    first event's time. What is kept is a suffix of each request's events, so the orphans of one request
    come innermost first: their `b`s go in reverse, outermost first, a nanosecond apart."""
    open_names: dict[str, list[str]] = {}
    orphans: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "b":
            open_names.setdefault(e["id"], []).append(e["name"])
        elif e["ph"] == "e":
            stack = open_names.get(e["id"])
            if stack:
                stack.pop()
            else:
                orphans.setdefault(e["id"], []).append(e)
    if not orphans:
        return events
    start = min(e["ts"] for e in events)
    begun = []
    for req_id, ends in orphans.items():
        for i, e in enumerate(reversed(ends)):
            begun.append(_async("b", e["name"], req_id, round(start + i * 1e-3, 3), {"truncated": True}))
    return begun + events
