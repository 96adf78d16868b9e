"""One engine replica: an `AsyncEngine` in a Ray Serve replica, streaming each request's outputs back.

    ingress ──handle.options(stream=True).generate.remote(prompt_ids, params, req_id, priority, slo)──►
        ("accepted", None, None) | ("refused", (kind, message), None)   first: a refusal is still a 400
        ("output", StepOutput, queue_s) ...     one per engine step that gave the request something;
                                                queue_s (arrival -> first scheduled) on the last one
        ("failed", detail, None)                the engine failed this request alone (a 500)

The stream is the whole contract: the ingress never calls into the engine otherwise. Cancelling the stream
(a client that left) cancels `generate`, whose `aclosing` aborts the engine request between two steps, as
in the single-process server. The first argument is the prompt's token ids: the request router reads it
there to hash the prompt's blocks (infer.deploy.router).

A replica runs torch on `num_threads` threads (the cores Ray gave it) and on the engine thread alone (see
infer.engine.async_engine for why). It reports its scheduler's counters to Ray Serve every
`request_routing_stats_period_s` through `record_routing_stats`; the ingress reads them for /metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import aclosing

from infer.config import EngineConfig
from infer.core.slo import Objectives
from infer.engine.async_engine import AsyncEngine, RequestFailed
from infer.engine.llm_engine import LLMEngine
from infer.sampling_params import SamplingParams
from infer.structured_outputs.compile_pool import CompileQueueFull

logger = logging.getLogger("infer.deploy")


class EngineReplica:
    """The body of the engine deployment (infer.deploy.app wraps it in `serve.deployment`)."""

    async def __init__(self, config: EngineConfig, num_threads: int):
        def build() -> LLMEngine:
            import torch

            torch.set_num_threads(num_threads)  # on the engine thread, the one that runs torch
            engine = LLMEngine(config)
            engine.warm_up()  # decode graphs and a frozen heap, before the replica reports healthy
            return engine

        self.num_threads = num_threads
        self.engine = AsyncEngine(factory=build)
        self.engine.start()
        await self.engine.ready()  # the replica is healthy only once its model is loaded

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        req_id: str,
        priority: int = 0,
        slo: Objectives | None = None,
        group_id: str | None = None,
    ):
        try:
            outputs = await self.engine.add(prompt_ids, params, req_id, priority, slo, group_id)
        except (ValueError, CompileQueueFull) as exc:  # refused (the kind tells the ingress which)
            yield ("refused", (type(exc).__name__, str(exc)), None)
            return
        yield ("accepted", None, None)
        async with aclosing(outputs):
            try:
                async for out in outputs:
                    # the finished Request stays here: the ingress times requests on its own clock
                    yield ("output", dataclasses.replace(out, request=None), _queue_s(out))
            except RequestFailed as exc:
                yield ("failed", exc.detail, None)

    async def facts(self) -> dict:
        """What the ingress needs to validate and admit requests as the engine would (no tensors)."""
        llm = self.engine.engine
        return {
            "config": llm.config,
            "model_config": llm.model_config,
            "cache_config": llm.cache_config,
            "scheduler_config": llm.scheduler_config,
            "max_model_len": llm.max_model_len,
            "max_request_tokens": llm.scheduler.kv_cache_manager.max_request_tokens,
            "kv_capacity_tokens": llm.kv_capacity_tokens,
            "kv_bytes_per_token": llm.kv_bytes_per_token,
            "dtype": str(llm.runner.dtype),
            "kv_cache_dtype": llm.kv_cache_dtype,
            "quantization": llm.quantization,
            "num_threads": self.num_threads,
            "pid": os.getpid(),
        }

    async def record_routing_stats(self) -> dict:
        """Ray Serve calls this every request_routing_stats_period_s; routers see it as `routing_stats`."""
        llm = self.engine.engine
        sched = llm.scheduler
        kv = sched.kv_cache_manager
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "kv_cache_usage": kv.usage,
            "num_preemptions": sched.num_preemptions,
            "prefix_query_tokens": kv.num_query_tokens,
            "prefix_hit_tokens": kv.num_hit_tokens,
            "pid": os.getpid(),
        }

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose health check raises: here, an engine thread that died."""
        thread = self.engine._thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the engine thread is not running")

    def __del__(self):
        self.engine.shutdown()


def _queue_s(out) -> float | None:
    req = out.request
    if req is None or req.first_scheduled_time is None:
        return None
    return max(0.0, req.first_scheduled_time - req.arrival_time)
