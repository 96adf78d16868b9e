"""`infer serve --replicas N`: N engine replicas as a Ray Serve deployment behind this process's endpoint.

    infer serve --replicas 2 --port 8000                  a local Ray instance, stopped on exit
    infer serve --replicas 4 --ray-address HOST:6379      join a running cluster: the same command scales
                                                          past one machine (the replicas go where Ray
                                                          places them; the endpoint stays here)

    client ─HTTP─► this process: uvicorn + infer.server's app (launch.py: the SIGTERM drain, start-up log)
                     └ ReplicaServerState.engine = RemoteEngine ─ DeploymentHandle, InferRequestRouter ─►
                                                                   "EngineReplica" x N (Ray Serve)

Why the endpoint is this process and not Ray Serve's HTTP proxy with an ingress deployment: every
streamed token would then cross two Ray hops (replica -> ingress -> proxy) instead of one, which on 2
cores doubled the ITL (docs/scaling.md); the router, the index and /metrics also live in one known
process this way. Ray Serve still owns what it is for: placing the replicas (`cpus // N` cores each),
restarting one that dies or fails its health check, and routing through our RequestRouter.

The deployment starts inside the server's loading phase (ReplicaServerState.load), so the port answers
503 "loading" meanwhile, as the single-process server does. This module imports Ray: only this path does
(`pip install infer[ray]`).
"""

from __future__ import annotations

import logging
import os

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from infer.config import usable_cores
from infer.deploy.args import ReplicaArgs, cpus_per_replica
from infer.deploy.ingress import ReplicaServerState
from infer.deploy.replica import EngineReplica
from infer.deploy.router import InferRequestRouter
from infer.server import launch
from infer.server.args import ServerArgs

logger = logging.getLogger("infer.deploy")
APP_NAME = "infer"
ENGINE_DEPLOYMENT = "EngineReplica"
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas report their scheduler's counters (for /metrics)


def build_app(args: ServerArgs, replica: ReplicaArgs, num_cpus: int):
    """The bound application: N engine replicas of `num_cpus` cores (and torch threads) each."""
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=replica.replicas,
        ray_actor_options={"num_cpus": num_cpus},
        # the endpoint admits (429 beyond --max-queued-requests); a replica never refuses what it is sent
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
    return engine.bind(args.engine, num_cpus)


def run(args: ServerArgs, replica: ReplicaArgs) -> int:
    """Start (or join) Ray, serve until SIGTERM (launch.run's drain), then take the replicas down."""
    kv_bytes = args.engine.kv_cache_memory_gb * 2**30 if args.engine.num_kv_blocks is None else 0
    if replica.ray_address is None:
        num_cpus = usable_cores()
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

    def deploy():
        """Blocks until every replica has loaded its model (raises if Ray Serve gives up)."""
        serve.start(proxy_location="Disabled")  # the HTTP endpoint is ours (launch.run)
        handle = serve.run(build_app(args, replica, cpus), name=APP_NAME, route_prefix=None)
        logger.info(
            "%d engine replicas x %d CPUs, routing %s", replica.replicas, cpus, replica.routing_policy
        )
        return handle

    try:
        return launch.run(args, ReplicaServerState(args, deploy, replica.replicas, ENGINE_DEPLOYMENT))
    finally:
        if replica.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)  # the cluster and its other applications stay
        ray.shutdown()
