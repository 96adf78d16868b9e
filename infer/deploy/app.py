"""The Ray Serve application: N engine replicas behind one ingress, and `infer serve --replicas N`.

    infer serve --replicas 2 --port 8000                  a local Ray instance, stopped on exit
    infer serve --replicas 4 --ray-address HOST:6379      join a cluster: the same command past one machine
    serve run infer.deploy.app:build replicas=2 routing_policy=round_robin    Ray's own CLI, any flag of
                                                          `infer serve` as key=value (dashes or underscores)

The application has two deployments: "Ingress" (one replica, no reserved core: infer.server's app, see
ingress.py) and "EngineReplica" (N replicas, `cpus // N` cores each: replica.py), whose handle routes
through InferRequestRouter (router.py). Ray Serve restarts a replica that dies or fails its health check;
its in-flight requests end with an error at the ingress.

This module imports Ray: only this path does (`pip install infer[ray]`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from ray import serve
from ray.serve.config import RequestRouterConfig

from infer.deploy.args import ReplicaArgs, cpus_per_replica
from infer.deploy.ingress import ReplicaServerState
from infer.deploy.replica import EngineReplica
from infer.deploy.router import InferRequestRouter
from infer.server.app import create_app
from infer.server.args import ServerArgs

logger = logging.getLogger("infer.deploy")
APP_NAME = "infer"
ENGINE_DEPLOYMENT = "EngineReplica"
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas report their scheduler's counters (for /metrics)


@serve.ingress()
class Ingress:
    """infer.server's FastAPI app, built on the replica (late-bound: the app holds a live handle)."""

    def __init__(self, args: ServerArgs, engine, num_replicas: int):
        self.args, self.engine, self.num_replicas = args, engine, num_replicas
        self.load_error: BaseException | None = None

    def __serve_build_asgi_app__(self):
        state = ReplicaServerState(self.args, self.engine, self.num_replicas, ENGINE_DEPLOYMENT)
        return create_app(
            self.args,
            on_ready=lambda _: _log_ready(self.args, state),
            on_fatal=lambda exc: setattr(self, "load_error", exc),
            state=state,
        )

    async def check_health(self) -> None:
        """Ray Serve restarts an ingress that could not reach a replica's facts (the app stays 503)."""
        if self.load_error is not None:
            raise RuntimeError(f"the ingress could not start: {self.load_error!r}")


def _log_ready(args: ServerArgs, state: ReplicaServerState) -> None:
    view = state.llm
    logger.info(
        "%d engine replicas of %s ready: max_model_len %d, KV cache %d tokens each, scheduler %s",
        state.num_replicas,
        args.model_name,
        view.max_model_len,
        view.kv_capacity_tokens,
        view.scheduler_config,
    )


def build_app(args: ServerArgs, replica: ReplicaArgs, num_cpus: int):
    """The bound application: `num_cpus` cores (and torch threads) per engine replica."""
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=replica.replicas,
        ray_actor_options={"num_cpus": num_cpus},
        # the ingress admits (429 beyond --max-queued-requests); a replica never refuses what it sends
        max_ongoing_requests=args.engine.max_num_seqs + args.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=InferRequestRouter,
            request_router_kwargs={
                "policy": replica.routing_policy,
                "block_size": args.engine.block_size,
                "imbalance_bound": replica.imbalance_bound,
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=args.drain_timeout,
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},  # HTTP, tokenizing, SSE: it shares the replicas' cores
        max_ongoing_requests=1_000_000,  # bounded by the app's own admission (429)
        graceful_shutdown_timeout_s=args.drain_timeout,
    )
    return ingress.bind(args, engine.bind(args.engine, num_cpus), replica.replicas)


def build(cli_args: dict[str, str]):
    """`serve run infer.deploy.app:build key=value ...`: the flags of `infer serve --replicas` as keys.
    Ray's CLI owns the cluster and the HTTP port there (`serve run --address`, serve's http_options)."""
    import argparse

    from infer.deploy.args import add_replica_args, replica_args
    from infer.server.args import add_server_args, parse_server_args

    parser = argparse.ArgumentParser(prog="serve run infer.deploy.app:build")
    add_server_args(parser)
    add_replica_args(parser)
    argv = []
    for key, value in cli_args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = parse_server_args(parser, argv)
    replica = replica_args(parser.parse_args(argv)) or ReplicaArgs()
    import ray

    cpus = len(os.sched_getaffinity(0))
    if ray.is_initialized():
        cpus = int(ray.cluster_resources().get("CPU", cpus))
    return build_app(args, replica, cpus_per_replica(replica.replicas, cpus, float("inf"), 0))


def run(args: ServerArgs, replica: ReplicaArgs) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM / SIGINT, then take the application down."""
    import ray

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    kv_bytes = args.engine.kv_cache_memory_gb * 2**30 if args.engine.num_kv_blocks is None else 0
    if replica.ray_address is None:
        num_cpus = len(os.sched_getaffinity(0))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cpus = cpus_per_replica(replica.replicas, num_cpus, memory, kv_bytes)  # refuse before starting Ray
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=replica.ray_address, logging_level=logging.WARNING)
        resources = ray.cluster_resources()
        try:
            cpus = cpus_per_replica(
                replica.replicas, int(resources.get("CPU", 0)), resources.get("memory", 0), kv_bytes
            )
        except ValueError:
            ray.shutdown()
            raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args, replica, cpus), name=APP_NAME, route_prefix="/")
        logger.info(
            "ready on http://%s:%d (OpenAI API under /v1): %d replicas x %d CPUs, routing %s",
            args.host, args.port, replica.replicas, cpus, replica.routing_policy,
        )  # fmt: skip
        stop.wait()
        logger.info("stopping: draining up to %gs", args.drain_timeout)
    finally:
        if replica.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)  # the cluster and its other applications stay
        ray.shutdown()
    return 0
