"""The routing policies (infer.deploy.routing) as Ray Serve's own request router, not a proxy of ours.

Ray Serve asks `choose_replicas(candidates, pending_request)` for ranks of replicas each time it routes a
request from a DeploymentHandle, in the caller's process: here the ingress, which calls
`EngineReplica.generate(prompt_ids, ...)`, so the prompt's token ids are `pending_request.args[0]`. Serve
then sends the request to the first rank's replica unless that replica is at `max_ongoing_requests`, and
tells us where it went (`on_request_routed`), which is when the prefix index learns the prompt's blocks.

    choose_replicas ──► loads (Serve's queue-length cache: requests sent and not finished per replica;
                        probed when missing) + the prompt's block hashes + the index ──► routing.choose
    on_request_routed ──► index.insert(replica, hashes)    the replica now holds (or computes) them
    update_replicas / on_replica_actor_died ──► forget the replicas that are gone (a restarted replica
                        has a new id and an empty cache)

The index also learns the first choice at decision time, before Serve's round trip to the replica
answers: otherwise a burst of requests sharing a prefix would all be routed before the first one landed,
each seeing an empty index. Decisions are counted by reason (`decisions`), which /metrics exposes.

Each ingress process holds its own router, hence its own index (approximate by design: see routing.py);
`routing.ROUTERS` lets that process's /metrics find it. (Ray Serve ships this class by value, module
globals included, so a registry defined here would be a copy: it lives in routing.py, reached through the
module, which travels by reference.)
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from infer.deploy import routing
from infer.deploy.routing import (
    DEFAULT_IMBALANCE_BOUND,
    DEFAULT_INDEX_BLOCKS,
    DEFAULT_POLICY,
    POLICIES,
    PrefixIndex,
    choose,
    prompt_block_hashes,
)

logger = logging.getLogger("infer.deploy")
_MAX_REMEMBERED = 4096  # requests whose hashes and turn are kept between choose and routed


class InferRequestRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = DEFAULT_POLICY,
        block_size: int = 16,
        imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
        index_blocks: int = DEFAULT_INDEX_BLOCKS,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy, self.block_size, self.imbalance_bound = policy, block_size, imbalance_bound
        self.index = PrefixIndex(index_blocks)
        self.decisions: Counter[str] = Counter()  # reason -> requests
        self.routed: Counter[str] = Counter()  # replica unique id -> requests
        self._turns = itertools.count()
        self._requests: OrderedDict[str, tuple[list[bytes], int]] = OrderedDict()
        routing.ROUTERS[self._deployment_id.name] = self

    def _request(self, pending_request: PendingRequest) -> tuple[list[bytes], int]:
        """The request's block hashes and turn, computed once however often Serve retries choosing."""
        key = pending_request.metadata.internal_request_id
        if key not in self._requests:
            hashes = []
            if self.policy == "prefix_aware" and pending_request.args:
                hashes = prompt_block_hashes(pending_request.args[0], self.block_size)
            self._requests[key] = (hashes, next(self._turns))
            while len(self._requests) > _MAX_REMEMBERED:
                self._requests.popitem(last=False)
        return self._requests[key]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        loads, missing = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id] = r.max_ongoing_requests if n is None else n  # unreachable: last
        return loads

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return [candidate_replicas]  # facts(), say: any replica, least loaded by Serve's own choice
        by_id = {r.replica_id: r for r in candidate_replicas}
        ids = sorted(by_id, key=lambda i: i.unique_id)  # a stable order for round-robin and ties
        hashes, turn = self._request(pending_request)
        loads = {} if self.policy == "round_robin" else await self._loads(candidate_replicas)
        decision = choose(self.policy, ids, loads, turn, hashes, self.index, self.imbalance_bound)
        self.decisions[decision.reason] += 1
        if hashes:
            self.index.insert(decision.first, hashes)
        return [[by_id[i] for i in rank] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if pending_request.metadata.call_method != "generate":
            return
        self.routed[replica_id.unique_id] += 1
        hashes, _ = self._requests.pop(pending_request.metadata.internal_request_id, ([], 0))
        if hashes:
            self.index.insert(replica_id, hashes)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.index.remove(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)
