"""Prometheus metrics with vLLM's names and meanings under the prefix `infer:`.

A dashboard or harness written for `vllm:` ports by renaming the prefix. Where each number comes from:

    histograms (observed on the engine thread when a request finishes, from its timestamps)
      time_to_first_token_seconds    first token - arrival
      inter_token_latency_seconds    gaps between consecutive output tokens
      e2e_request_latency_seconds    finished - arrival
      request_queue_time_seconds     first scheduled - arrival (time spent WAITING)
    counters
      prompt_tokens_total            prompt tokens of requests that produced their first token
      generation_tokens_total        output tokens produced
      request_success_total{finished_reason}   finished requests, by "stop" | "length" | "abort"
      num_preemptions_total, prefix_cache_queries_total, prefix_cache_hits_total
                                     read from the scheduler at scrape time (tokens, as vLLM counts them)
    gauges (read at scrape time)
      num_requests_running, num_requests_waiting, kv_cache_usage_perc (blocks held by requests / pool;
      cached blocks no request holds count as free)

`arrival` is when the HTTP handler received the request (`note_arrival`), else when the engine thread took
it (a request aborted by a disconnect is forgotten by the HTTP side first). The engine thread writes the
histograms and counters under a lock; the HTTP side renders them under the same lock and reads the
scheduler's counters as plain ints (never calling into the engine).
"""

from __future__ import annotations

import threading
from bisect import bisect_left

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine, StepOutput

PREFIX = "infer:"
# vLLM's buckets, so that quantiles computed from them compare.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, labels: str) -> list[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines += [f"{name}_count{{{labels}}} {cumulative}", f"{name}_sum{{{labels}}} {self.sum!r}"]
        return lines


class Metrics:
    """Request-level statistics, fed by `MeteredEngine` on the engine thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.arrivals: dict[str, float] = {}  # req_id -> time.monotonic() at HTTP arrival

    def note_arrival(self, req_id: str, now: float) -> None:
        self.arrivals[req_id] = now

    def forget(self, req_id: str) -> None:
        self.arrivals.pop(req_id, None)

    def observe_step(self, outputs: list[StepOutput], requests: dict) -> None:
        """Called on the engine thread with one step's outputs and the requests as they were before it."""
        with self.lock:
            for out in outputs:
                self.num_generation_tokens += len(out.token_ids)
                if out.token_ids and out.num_output_tokens == len(out.token_ids):  # its first tokens
                    self.num_prompt_tokens += out.num_prompt_tokens
                if out.finished and (req := requests.get(out.req_id)) is not None:
                    self._observe_finished(req, out.finish_reason)

    def _observe_finished(self, req, reason: str | None) -> None:
        if reason in self.num_finished:
            self.num_finished[reason] += 1
        arrival = self.arrivals.get(req.req_id, req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(max(0.0, req.first_scheduled_time - arrival))
        if req.first_token_time is not None:
            self.ttft.observe(max(0.0, req.first_token_time - arrival))
        for before, after in zip(req.token_times, req.token_times[1:], strict=False):
            self.itl.observe(after - before)
        if req.finished_time is not None:
            self.e2e.observe(max(0.0, req.finished_time - arrival))

    def render(self, engine: LLMEngine, model_name: str) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        labels = f'model_name="{_escape(model_name)}"'
        sched = engine.scheduler
        kv = sched.kv_cache_manager
        with self.lock:
            scalars = [
                ("gauge", "num_requests_running", "Number of requests in model execution batches.",
                 sched.num_running),
                ("gauge", "num_requests_waiting", "Number of requests waiting to be processed.",
                 sched.num_waiting),
                ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv.usage),
                ("counter", "num_preemptions_total", "Cumulative number of preemption from the engine.",
                 sched.num_preemptions),
                ("counter", "prefix_cache_queries_total",
                 "Prefix cache queries, in terms of number of queried tokens.", kv.num_query_tokens),
                ("counter", "prefix_cache_hits_total",
                 "Prefix cache hits, in terms of number of cached tokens.", kv.num_hit_tokens),
                ("counter", "prompt_tokens_total", "Number of prefill tokens processed.",
                 self.num_prompt_tokens),
                ("counter", "generation_tokens_total", "Number of generation tokens processed.",
                 self.num_generation_tokens),
            ]  # fmt: skip
            lines = []
            for kind, name, help, value in scalars:
                name = PREFIX + name
                lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
            name = PREFIX + "request_success_total"
            lines += [f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter"]
            for reason, n in self.num_finished.items():
                lines.append(f'{name}{{{labels},finished_reason="{reason}"}} {n}')
            for hist in (self.ttft, self.itl, self.e2e, self.queue):
                lines += hist.render(labels)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MeteredEngine(LLMEngine):
    """LLMEngine that reports each step's outputs (and aborts) to `Metrics`, on the engine thread.

    Only the public surface is used: `requests` is snapshotted before a step because a finished
    request leaves it during the step, and its timestamps are needed after."""

    def __init__(self, config: EngineConfig, metrics: Metrics):
        super().__init__(config)
        self.metrics = metrics

    def step(self) -> list[StepOutput]:
        requests = dict(self.requests)
        outputs = super().step()
        self.metrics.observe_step(outputs, requests)
        return outputs

    def abort(self, req_ids: str | list[str]) -> list[StepOutput]:
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        requests = {i: self.requests[i] for i in ids if i in self.requests}
        outputs = super().abort(req_ids)
        self.metrics.observe_step(outputs, requests)
        return outputs
