"""The ingress: the single-process server's own FastAPI app, whose engine is N replicas behind a handle.

    client ─HTTP─► infer.server's app, unchanged (validation, chat template, tokenizing, admission
                   503/429, errors, SSE, /metrics, the SIGTERM drain)
                     state.engine = RemoteEngine ── handle.generate(prompt_ids, ...) ──►
                     InferRequestRouter picks the replica (infer.deploy.router) ──► EngineReplica x N

Nothing of the HTTP API is written twice: `create_app` gets a `ReplicaServerState`, whose `engine` has
`AsyncEngine.add`'s contract (a refusal raises ValueError before any output; the iterator yields
StepOutputs; closing it aborts; a failed request raises RequestFailed) and whose `llm` is an `EngineView`
of one replica's facts (the tokenizer, limits and configs the routes read). So the errors, shapes and
admission rules are the single-process server's, with two differences: the admission bound counts every
replica's batch slots (`max_num_seqs` x N), and a replica that dies fails its in-flight requests with
RequestFailed (a 500, or an error event in a stream) while Ray Serve restarts it.

/metrics, per source:
- request histograms and counters (TTFT, ITL, e2e, queue time, tokens, finished requests by reason):
  aggregated over all replicas, observed here as the outputs arrive, on this process's clock (so TTFT is
  what the client sees, routing and transport included; queue time is the replica's own);
- scheduler gauges and counters (running, waiting, KV usage, preemptions, prefix-cache queries and hits):
  one sample per replica (label `replica`), from the stats each replica reports every
  `request_routing_stats_period_s` (1 s), so up to ~1-2 s old; Prometheus sums them with sum();
- `infer:router_decisions_total{reason}` and `infer:router_requests_total{replica}`: the router's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infer.core.slo import LateRequest, Objectives
from infer.deploy.routing import ROUTERS
from infer.engine.async_engine import RequestFailed
from infer.engine.llm_engine import StepOutput
from infer.engine.tokenizer import load_tokenizer
from infer.models.loader import resolve_model_path
from infer.sampling_params import SamplingParams
from infer.server.args import ServerArgs
from infer.server.metrics import PREFIX, Metrics
from infer.server.server_state import ServerState
from infer.structured_outputs.compile_pool import CompileQueueFull
from infer.structured_outputs.compiler import GrammarCompiler

logger = logging.getLogger("infer.deploy")


class EngineView:
    """What the HTTP side reads from `state.llm`, built from one replica's `facts()` (all replicas share
    one configuration). `scheduler_config.max_num_seqs` is the sum over replicas: admission counts every
    replica's batch slots."""

    def __init__(self, facts: dict, num_replicas: int):
        self.config = facts["config"]
        self.model_config = facts["model_config"]
        self.cache_config = facts["cache_config"]
        sched = facts["scheduler_config"]
        self.scheduler_config = SimpleNamespace(
            **{**dataclasses.asdict(sched), "max_num_seqs": sched.max_num_seqs * num_replicas}
        )
        self.max_model_len = facts["max_model_len"]
        self.kv_capacity_tokens = facts["kv_capacity_tokens"]  # one replica's: what one request can use
        self.kv_bytes_per_token = facts["kv_bytes_per_token"]
        self.quantization = facts["quantization"]
        self.kv_cache_dtype = facts["kv_cache_dtype"]
        self.runner = SimpleNamespace(dtype=facts["dtype"])
        kv = SimpleNamespace(max_request_tokens=facts["max_request_tokens"])
        self.scheduler = SimpleNamespace(kv_cache_manager=kv)
        self.trace = None  # refused at start with --replicas (infer.deploy.args)
        path = resolve_model_path(self.config.model, self.config.load_format)
        self.tokenizer = load_tokenizer(path, self.config.tokenizer)  # as LLMEngine finds it
        self.grammars = GrammarCompiler.from_config(self.config, self.tokenizer, self.model_config.vocab_size)


@dataclasses.dataclass
class _Timeline:
    """One request's times on the ingress's clock, shaped as the Request fields Metrics reads."""

    req_id: str
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    def note(self, out: StepOutput, queue_s: float | None) -> None:
        now = time.monotonic()
        if out.token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_times += [now] * len(out.token_ids)
        if queue_s is not None:
            self.first_scheduled_time = self.arrival_time + queue_s
        if out.finished:
            self.finished_time = now


class RemoteEngine:
    """`AsyncEngine.add` over the engine deployment's handle (what infer.server.fanout.Fanout calls)."""

    def __init__(self, handle, metrics: Metrics):
        self.handle = handle.options(stream=True)
        self.metrics = metrics

    async def add(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        priority: int = 0,
        slo: Objectives | None = None,
        group_id: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Raises ValueError (refused), or RequestFailed (no replica answered); see AsyncEngine.add. A
        group's choices share the seats of whichever replica each is routed to."""
        arrival = self.metrics.arrivals.get(req_id, time.monotonic())
        stream = self.handle.generate.remote(
            list(prompt), params or SamplingParams(), req_id, priority, slo, group_id
        )
        try:
            kind, payload, _ = await stream.__anext__()
        except Exception as exc:
            stream.cancel()
            raise _replica_error(req_id, exc) from exc
        except BaseException:  # cancelled: the client left
            stream.cancel()
            raise
        if kind == "refused":
            name, message = payload
            if name == CompileQueueFull.__name__:
                raise CompileQueueFull(message)
            raise LateRequest(message) if name == LateRequest.__name__ else ValueError(message)
        return self._outputs(req_id, stream, _Timeline(req_id, arrival))

    async def _outputs(self, req_id: str, stream, timeline: _Timeline) -> AsyncIterator[StepOutput]:
        finished = failed = False
        try:
            while not finished:
                try:
                    kind, payload, queue_s = await stream.__anext__()
                except StopAsyncIteration:
                    failed = True
                    raise RequestFailed(req_id, "the replica's stream ended before the request") from None
                except Exception as exc:
                    failed = True
                    raise _replica_error(req_id, exc) from exc
                if kind == "failed":
                    finished = True
                    raise RequestFailed(req_id, payload)
                timeline.note(payload, queue_s)
                self.metrics.observe_step([payload], {req_id: timeline})
                finished = payload.finished
                yield payload
        finally:
            if not finished:  # closed early (the client left) or its replica failed: end it there too
                stream.cancel()
                if not failed:  # as the engine counts an abort (a failure is no finish reason)
                    self.metrics.finished["abort"].inc()


def _replica_error(req_id: str, exc: Exception) -> RequestFailed:
    """A replica that died (or could not be reached) fails the request: a 500, never a hang."""
    logger.error("request %s: its replica failed: %s: %s", req_id, type(exc).__name__, exc)
    return RequestFailed(req_id, f"replica failed: {type(exc).__name__}")


class ReplicaServerState(ServerState):
    """ServerState whose engine is the replica deployment. `load` deploys it (`deploy()` blocks until
    every replica is up and returns the handle), then asks one replica for its facts."""

    def __init__(self, args: ServerArgs, deploy, num_replicas: int, deployment_name: str):
        super().__init__(args)
        self.deploy, self.num_replicas, self.deployment_name = deploy, num_replicas, deployment_name
        self.handle = None
        self.view: EngineView | None = None

    async def load(self, on_fatal=None) -> None:  # a replica that dies is Ray's to restart, not fatal
        self.handle = await asyncio.to_thread(self.deploy)
        facts = await self.handle.facts.remote()
        self.view = await asyncio.to_thread(EngineView, facts, self.num_replicas)  # reads the tokenizer
        self.engine = RemoteEngine(self.handle, self.metrics)
        self.metrics.registry.register(ReplicaCollector(self.deployment_name, self.args.model_name))
        self.ready = True

    def shutdown(self) -> None:
        pass  # the replicas are Ray Serve's to stop

    @property
    def llm(self) -> EngineView:
        return self.view


# (name, kind, help, routing-stats key): infer.server.metrics' names and help texts
_REPLICA_METRICS = (
    ("num_requests_running", GaugeMetricFamily, "Number of requests in model execution batches.",
     "num_running"),
    ("num_requests_waiting", GaugeMetricFamily, "Number of requests waiting to be processed.",
     "num_waiting"),
    ("kv_cache_usage_perc", GaugeMetricFamily, "KV-cache usage. 1 means 100 percent usage.",
     "kv_cache_usage"),
    ("num_preemptions_total", CounterMetricFamily, "Cumulative number of preemption from the engine.",
     "num_preemptions"),
    ("prefix_cache_queries_total", CounterMetricFamily,
     "Prefix cache queries, in terms of number of queried tokens.", "prefix_query_tokens"),
    ("prefix_cache_hits_total", CounterMetricFamily,
     "Prefix cache hits, in terms of number of cached tokens.", "prefix_hit_tokens"),
)  # fmt: skip


class ReplicaCollector:
    """Per-replica scheduler values (the stats each replica last reported) and the router's counts."""

    def __init__(self, deployment_name: str, model_name: str):
        self.deployment_name, self.model_name = deployment_name, model_name

    def collect(self):
        router = ROUTERS.get(self.deployment_name)
        if router is None:
            return
        replicas = sorted(router.curr_replicas.values(), key=lambda r: r.replica_id.unique_id)
        for name, kind, help, key in _REPLICA_METRICS:
            family = kind(PREFIX + name, help, labels=["model_name", "replica"])
            for r in replicas:
                if key in (r.routing_stats or {}):
                    family.add_metric([self.model_name, r.replica_id.unique_id], r.routing_stats[key])
            yield family
        decisions = CounterMetricFamily(
            PREFIX + "router_decisions_total", "Routing decisions by reason.", labels=["model_name", "reason"]
        )
        for reason, n in sorted(router.decisions.items()):
            decisions.add_metric([self.model_name, reason], n)
        yield decisions
        routed = CounterMetricFamily(
            PREFIX + "router_requests_total", "Requests routed, by replica.", labels=["model_name", "replica"]
        )
        for replica, n in sorted(router.routed.items()):
            routed.add_metric([self.model_name, replica], n)
        yield routed
