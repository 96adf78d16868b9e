"""The replica flags of `infer serve` and the rule that refuses more replicas than the machine holds.

    infer serve --replicas 2 [--routing-policy prefix_aware|least_loaded|round_robin]
                [--routing-imbalance-bound 4] [--ray-address ADDR]

No Ray here: the flags parse (and `--help` lists them) without the `ray` extra installed. Without
`--replicas` (and without `--ray-address`) `infer serve` is the single-process server, as before.

How many replicas fit: each replica gets `cpus // N` whole cores for Ray's scheduler and as torch
threads (at least one: replicas sharing a core would make OpenMP threads fight, which costs more than the
second replica adds), where `cpus` is the cores this process may run on (a local Ray instance) or the
cluster's CPUs (`--ray-address`). Each replica also holds its own KV pool, so N pools must fit in 80% of
the memory (the weights and Ray come on top).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from infer.deploy.routing import DEFAULT_IMBALANCE_BOUND, DEFAULT_POLICY, POLICIES

MEMORY_SHARE = 0.8  # of the machine's (or cluster's) memory that the replicas' KV pools may take


@dataclass(frozen=True)
class ReplicaArgs:
    replicas: int = 1
    ray_address: str | None = None
    routing_policy: str = DEFAULT_POLICY
    imbalance_bound: int = DEFAULT_IMBALANCE_BOUND


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (needs `pip install infer[ray]`)")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas behind one endpoint, as a Ray Serve deployment (default: one engine "
        "in this process, no Ray)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. ray://host:10001 or host:6379) instead of starting a local one",
    )
    group.add_argument(
        "--routing-policy",
        default=DEFAULT_POLICY,
        choices=POLICIES,
        help="which replica serves a request: prefix_aware (the one likely to hold its prefix blocks, "
        "unless too loaded), least_loaded (fewest requests in flight), round_robin",
    )
    group.add_argument(
        "--routing-imbalance-bound",
        type=int,
        default=DEFAULT_IMBALANCE_BOUND,
        help="prefix_aware: requests in flight a replica may carry beyond the least loaded one and still "
        "get a request for its cached prefix",
    )


def replica_args(ns: argparse.Namespace) -> ReplicaArgs | None:
    """The replica settings, or None for the single-process server. Raises ValueError for bad values."""
    if ns.replicas is None and ns.ray_address is None:
        return None
    replicas = 1 if ns.replicas is None else ns.replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if ns.routing_imbalance_bound < 0:
        raise ValueError(f"--routing-imbalance-bound must be >= 0, got {ns.routing_imbalance_bound}")
    if getattr(ns, "trace_path", None):
        raise ValueError("--trace is not supported with --replicas yet: trace a single-process server")
    if getattr(ns, "tensor_parallel_size", 1) > 1:
        raise ValueError(
            "--tensor-parallel-size is not supported with --replicas yet: a replica is one process"
        )
    return ReplicaArgs(replicas, ns.ray_address, ns.routing_policy, ns.routing_imbalance_bound)


def cpus_per_replica(num_replicas: int, num_cpus: int, memory_bytes: float, kv_bytes: float) -> int:
    """Whole cores for each replica; ValueError, with the numbers, when N replicas do not fit. kv_bytes:
    one replica's KV pool (0 when only the replica knows it: --num-kv-blocks, sized by the model)."""
    if num_replicas > num_cpus:
        raise ValueError(
            f"--replicas {num_replicas} needs at least {num_replicas} CPUs (one per replica: replicas "
            f"sharing a core slow each other down more than they add), and {num_cpus} are available; "
            f"use --replicas {max(1, num_cpus)} or fewer"
        )
    needed = num_replicas * kv_bytes
    if needed > MEMORY_SHARE * memory_bytes:
        raise ValueError(
            f"--replicas {num_replicas} would hold {num_replicas} KV pools of {kv_bytes / 2**30:.2f} "
            f"GiB ({needed / 2**30:.1f} GiB), more than {MEMORY_SHARE:.0%} of the "
            f"{memory_bytes / 2**30:.1f} GiB of memory; use fewer replicas or a smaller --kv-cache-memory-gb"
        )
    return num_cpus // num_replicas
