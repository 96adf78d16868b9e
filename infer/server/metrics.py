"""Prometheus metrics with vLLM's names and meanings under the prefix `infer:`, through prometheus-client.

A dashboard or harness written for `vllm:` ports by renaming the prefix. Every sample carries the label
`model_name` (a server of several models adds `model`, the same name: infer.server.model_manager).
Where each number comes from:

    histograms (observed on the engine thread when a request finishes, from its timestamps)
      time_to_first_token_seconds    first token - arrival
      inter_token_latency_seconds    gaps between consecutive output tokens
      e2e_request_latency_seconds    finished - arrival (a pooling input: its HTTP request's admission
                                     to its outputs)
      request_queue_time_seconds     first scheduled - arrival (time spent WAITING)
    counters
      prompt_tokens_total            prompt tokens of requests that produced their first token, and of
                                     pooling inputs (an embedded text, a scored pair) once computed
      generation_tokens_total        output tokens produced
      request_success_total{finished_reason}   finished requests, by "stop" | "length" | "abort"; each
                                     pooling input is one, "stop" (vLLM's engine request per input)
      num_preemptions_total, prefix_cache_queries_total, prefix_cache_hits_total
                                     read from the scheduler at scrape time (tokens, as vLLM counts them)
      num_interrupted_steps_total    ours: steps of prefill chunks stopped between layers for a newcomer
                                     and run again (infer/engine/llm_engine.py, "Interrupted steps")
    gauges (read at scrape time)
      num_requests_running, num_requests_waiting, kv_cache_usage_perc (blocks held by requests / pool;
      cached blocks no request holds count as free)
    with --speculative-config only: counters read from the scheduler at scrape time, each with `_total`
      spec_decode_num_drafts (decodes that verified proposals), spec_decode_num_draft_tokens (proposals),
      spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos{position} (accepted at
      position 0 .. num_speculative_tokens - 1 of a step's proposals; acceptance rate per position =
      it / spec_decode_num_drafts)

`arrival` is when the HTTP handler received the request (`note_arrival`), else when the engine thread took
it (a request aborted by a disconnect is forgotten by the HTTP side first). Each app has its own
`CollectorRegistry` (several servers in one process, as in tests, must not share counters). The engine
thread observes into the library's metrics, which lock themselves; a scrape reads the scheduler's counters
as plain ints (never calling into the engine).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine, StepOutput

# No `<name>_created` samples: vLLM's exposition has none, and they would double every counter's lines.
disable_created_metrics()

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


class Metrics:
    """Request-level statistics, fed by `MeteredEngine` on the engine thread; `render` answers a scrape."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine: LLMEngine | None = None  # set once loaded: the scrape-time values come from it
        label = {"model_name": model_name}

        def histogram(name: str, help: str, buckets: tuple[float, ...]):
            family = Histogram(PREFIX + name, help, ["model_name"], buckets=buckets, registry=self.registry)
            return family.labels(**label)

        def counter(name: str, help: str):
            return Counter(PREFIX + name, help, ["model_name"], registry=self.registry).labels(**label)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Number of generation tokens processed.")
        success = Counter(
            PREFIX + "request_success_total", "Count of successfully processed requests.",
            ["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip
        # every reason from the start, at 0, so that a rate() over it exists before the first of each
        self.finished = {r: success.labels(finished_reason=r, **label) for r in FINISH_REASONS}
        self.registry.register(_EngineCollector(self, model_name))
        self.arrivals: dict[str, float] = {}  # req_id -> time.monotonic() at HTTP arrival

    def note_arrival(self, req_id: str, now: float) -> None:
        self.arrivals[req_id] = now

    def forget(self, req_id: str) -> None:
        self.arrivals.pop(req_id, None)

    def observe_step(self, outputs: list[StepOutput], requests: dict) -> None:
        """Called on the engine thread with one step's outputs and the requests as they were before it."""
        for out in outputs:
            self.generation_tokens.inc(len(out.token_ids))
            if out.token_ids and out.num_output_tokens == len(out.token_ids):  # its first tokens
                self.prompt_tokens.inc(out.num_prompt_tokens)
            if out.finished and (req := requests.get(out.req_id)) is not None:
                self._observe_finished(req, out.finish_reason)

    def observe_pooling(self, num_prompt_tokens: list[int], latency: float) -> None:
        """A pooling request's inputs, done `latency` seconds after it was admitted: each one a finished
        request ("stop") whose prompt was processed, as vLLM's engine counts its pooling requests."""
        self.prompt_tokens.inc(sum(num_prompt_tokens))
        self.finished["stop"].inc(len(num_prompt_tokens))
        for _ in num_prompt_tokens:
            self.e2e.observe(latency)

    def _observe_finished(self, req, reason: str | None) -> None:
        if reason in self.finished:
            self.finished[reason].inc()
        arrival = self.arrivals.get(req.req_id, req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(max(0.0, req.first_scheduled_time - arrival))
        if req.first_token_time is not None:
            self.ttft.observe(max(0.0, req.first_token_time - arrival))
        for before, after in zip(req.token_times, req.token_times[1:], strict=False):
            self.itl.observe(after - before)
        if req.finished_time is not None:
            self.e2e.observe(max(0.0, req.finished_time - arrival))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format the scraper's Accept header asks for (the
        Prometheus text format by default, OpenMetrics if asked), as prometheus-client's own handler."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _EngineCollector:
    """The values the scheduler keeps itself, read at scrape time (nothing before the engine is loaded)."""

    def __init__(self, metrics: Metrics, model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def collect(self):
        engine = self.metrics.engine
        if engine is None:
            return
        sched = engine.scheduler
        kv = sched.kv_cache_manager
        for kind, name, help, value in (
            (GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
             sched.num_running),
            (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
             sched.num_waiting),
            (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             kv.usage),
            (CounterMetricFamily, "num_preemptions_total", "Cumulative number of preemption from the engine.",
             sched.num_preemptions),
            (CounterMetricFamily, "prefix_cache_queries_total",
             "Prefix cache queries, in terms of number of queried tokens.", kv.num_query_tokens),
            (CounterMetricFamily, "prefix_cache_hits_total",
             "Prefix cache hits, in terms of number of cached tokens.", kv.num_hit_tokens),
            (CounterMetricFamily, "num_interrupted_steps_total",
             "Steps of prefill chunks stopped between layers for a newcomer, to be run again.",
             engine.num_interrupted_steps),
        ):  # fmt: skip
            family = kind(PREFIX + name, help, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        spec = engine.config.speculative_config
        if spec is not None:
            yield from self._spec_decode(sched, spec.num_speculative_tokens)

    def _spec_decode(self, sched, num_positions: int):
        """vLLM's speculative-decoding counters: verifications, proposals, accepted ones (per position)."""
        for name, help, value in (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", sched.num_spec_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", sched.num_spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", sched.num_spec_accepted_tokens),
        ):
            family = CounterMetricFamily(PREFIX + name, help, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        per_pos = sched.num_spec_accepted_per_pos
        for pos in range(num_positions):
            family.add_metric([self.model_name, str(pos)], per_pos[pos] if pos < len(per_pos) else 0)
        yield family


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
