"""Which replica serves a request: the three routing policies, as pure Python (no Ray, no torch).

    round_robin    replica k, k+1, ... in turn, whatever they hold or carry
    least_loaded   the replica with the fewest requests in flight (running + waiting in its engine)
    prefix_aware   the replica most likely to hold the prompt's first KV blocks, unless it carries more
                   than `imbalance_bound` requests beyond the least loaded one; then least loaded

Prefix-aware routing, and why it is built this way. A replica's engine caches full KV blocks under chained
hashes (infer.core.block_hash): block i's hash covers every token before it, so equal hashes mean equal
prefixes. The router hashes each prompt's full blocks the same way (same block size) and keeps, per
replica, the hashes of the prompts it sent there (`PrefixIndex`). It never asks a replica what it holds:
that would cost a round trip per request and the answer would be stale by the time the request lands. The
index is approximate in both directions, and both errors only cost a cache miss, never a wrong answer: a
replica may have evicted blocks the index still lists (its KV pool is finite), and requests routed by
another ingress are not listed. It is bounded: an LRU of `max_blocks` hashes per replica (16 bytes each),
about the size of a replica's KV pool by default, so it forgets roughly when the replica would.

A prompt's match on a replica is the number of its leading blocks the index lists there; since the hashes
are chained, this is the longest prefix routed there before (what SGLang's cache-aware router gets from a
radix tree of prompt text, here with the engine's own block keys). Among the replicas of longest match the
least loaded wins, and it is chosen only while its load exceeds the least loaded replica's by at most
`imbalance_bound` requests: a popular prefix would otherwise pile every request onto one replica while the
others idle, which costs more TTFT than a recomputed prefix saves. Past the bound the request goes to the
least loaded replica, which then holds that prefix too, so a hot prefix spreads over as many replicas as
its load needs. A prompt with no match anywhere goes to the least loaded replica.

Loads are requests in flight per replica, as the router counts them (sent and not finished): they include
requests the replica's engine has not taken yet. Ties between equal loads rotate (`turn`), so that idle
replicas share sequential traffic instead of the first one taking it all.

A decision is a list of ranks, most preferred first (Ray Serve's `choose_replicas` contract): the router
sends to the first rank's replica unless it is full, then tries the next rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from infer.core.block_hash import BlockHash, hash_blocks

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
DEFAULT_POLICY = "prefix_aware"
DEFAULT_IMBALANCE_BOUND = 4  # requests in flight beyond the least loaded replica
DEFAULT_INDEX_BLOCKS = 65_536  # hashes remembered per replica (~1 MiB each; a 1 GiB KV pool of the
# embedded model holds ~70k blocks of 16 tokens)

ReplicaKey = Hashable  # a Ray Serve ReplicaID in the router, a string in tests
ROUTERS: dict = {}  # deployment name -> the InferRequestRouter of this process (read by /metrics)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, exactly as the engine's prefix cache keys them."""
    return hash_blocks(token_ids, block_size, [], len(token_ids) // block_size)


class PrefixIndex:
    """Per replica, the block hashes of the prompts routed there: an LRU of at most `max_blocks` each."""

    def __init__(self, max_blocks: int = DEFAULT_INDEX_BLOCKS):
        if max_blocks < 1:
            raise ValueError(f"the prefix index needs max_blocks >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: dict[ReplicaKey, OrderedDict[BlockHash, None]] = {}

    def insert(self, replica: ReplicaKey, hashes: Sequence[BlockHash]) -> None:
        """Record that `replica` now holds these blocks. The deepest block is touched first and the first
        block last, so eviction takes a prefix's tail before its head (a match needs the head)."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match(self, replica: ReplicaKey, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the index lists on `replica` (does not touch the LRU)."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def remove(self, replica: ReplicaKey) -> None:
        """Forget a replica (it died: its successor starts with an empty cache)."""
        self._blocks.pop(replica, None)

    def num_blocks(self, replica: ReplicaKey) -> int:
        return len(self._blocks.get(replica, ()))


@dataclass(frozen=True)
class Decision:
    """Ranks of replicas, most preferred first, and why (for logs and tests)."""

    ranks: list[list[ReplicaKey]]
    reason: str  # round_robin | least_loaded | prefix | no_match | imbalanced
    matched_blocks: int = 0

    @property
    def first(self) -> ReplicaKey:
        return self.ranks[0][0]


def by_load(replicas: Sequence[ReplicaKey], loads: Mapping[ReplicaKey, int], turn: int) -> list[ReplicaKey]:
    """Replicas from least to most loaded; equal loads in an order that rotates with `turn`."""
    n = len(replicas)
    rotation = {r: (i - turn) % n for i, r in enumerate(replicas)}
    return sorted(replicas, key=lambda r: (loads.get(r, 0), rotation[r]))


def choose(
    policy: str,
    replicas: Sequence[ReplicaKey],
    loads: Mapping[ReplicaKey, int],
    turn: int,
    hashes: Sequence[BlockHash] = (),
    index: PrefixIndex | None = None,
    imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
) -> Decision:
    """Rank `replicas` (in a stable order, e.g. sorted ids) for one request. `loads`: requests in flight
    per replica (missing = 0); `turn`: a counter the caller advances once per request; `hashes`: the
    prompt's block hashes (prefix_aware). Pure: neither `index` nor anything else is changed."""
    if not replicas:
        raise ValueError("no replica to route to")
    if policy == "round_robin":
        k = turn % len(replicas)
        order = [*replicas[k:], *replicas[:k]]
        return Decision([[r] for r in order], "round_robin")
    ordered = by_load(replicas, loads, turn)
    if policy == "least_loaded":
        return Decision([[r] for r in ordered], "least_loaded")
    if policy != "prefix_aware":
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
    matches = {r: index.match(r, hashes) for r in replicas} if index is not None and hashes else {}
    best = max(matches.values(), default=0)
    if best == 0:
        return Decision([[r] for r in ordered], "no_match")
    chosen = next(r for r in ordered if matches[r] == best)  # the least loaded of the longest matches
    if loads.get(chosen, 0) - loads.get(ordered[0], 0) > imbalance_bound:
        return Decision([[r] for r in ordered], "imbalanced", best)
    return Decision([[chosen]] + [[r] for r in ordered if r != chosen], "prefix", best)
