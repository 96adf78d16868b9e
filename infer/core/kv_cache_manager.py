"""Which KV blocks each request holds: prefix hits, allocation with eviction, freeing, integrity.

The token ranges of one request at allocation time (block_size = 4):

    token_ids:  | p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 pA pB | pC pD |
                |<-- prefix hit (cached) -->|<------ new tokens ------>|
                 computed_blocks (first allocation only)    this step's num_new_tokens
    block table: [ hit0, hit1 ]  + allocate_slots -> [ new0, new1 ]

* `num_computed_tokens` tokens already have KV in the request's blocks (0 for an admission);
* a prefix hit covers whole cached blocks and stops before the last token, which is always recomputed
  (its logits are needed to sample);
* `allocate_slots` makes room for `num_computed + hit + new` tokens, or changes nothing and returns None.

Invariants: a block is in a table at most once; a block's ref_cnt equals the number of tables holding it;
only full blocks whose KV has been computed carry a hash (`cache_blocks` runs after the step).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence

from infer.config import CacheConfig
from infer.core.block_hash import hash_blocks
from infer.core.block_pool import Block, BlockPool
from infer.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV cache: blocks handed out as sequences grow, full blocks shared through the prefix cache."""

    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.enable_caching = cache_config.prefix_caching
        self.max_request_tokens = self.num_blocks * self.block_size  # the most one request can hold
        self.pool = BlockPool(self.num_blocks, self.enable_caching)
        self._tables: dict[str, list[Block]] = {}
        self._table_ids: dict[str, list[int]] = {}  # the same tables as ids, kept for the runner
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already offered to the cache
        # Prefix-cache counters, recorded when a request is admitted (not on failed lookups).
        self.num_queries = 0  # admissions looked up
        self.num_query_tokens = 0  # tokens of those requests
        self.num_hits = 0  # admissions with at least one block hit
        self.num_hit_tokens = 0  # tokens served from the cache

    # -- stats ---------------------------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (evictable)."""
        return self.pool.num_cached_free

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing. used + cached + free == num_blocks."""
        return self.pool.num_allocatable_blocks - self.pool.num_cached_free

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests; cached unreferenced blocks count as free."""
        return self.pool.num_used_blocks / self.num_blocks

    # -- per-request operations ----------------------------------------------------------------------

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks that prefixes req's tokens, and the tokens it covers.

        Stops before the block holding the last token, which must be recomputed. Does not take
        references (pass the blocks to `allocate_slots`, which does) and changes no counter.
        """
        if not self.enable_caching:
            return [], 0
        if req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
            return [], 0  # every prompt position must be computed for its logprob (as vLLM)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = hash_blocks(req.token_ids, self.block_size, req.block_hashes, max_blocks)
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Block] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens of req; return the ids of the blocks added.

        computed_blocks: the prefix hit from `get_computed_blocks`, only for the first allocation of
        an admission (req.num_computed_tokens == 0 and no table yet). Returns None and changes nothing
        when the free queue (cached blocks included: they are evicted in LRU order) cannot supply the
        blocks. On success the hit blocks are referenced and prepended to the table.
        num_lookahead_tokens: slots past the known sequence, for proposals a speculative step verifies.
        The ones rejected are rolled back by the scheduler lowering num_computed_tokens: their blocks
        stay in the table for the next step's tokens (never hashed: `cache_blocks` stops at the computed
        tokens) and go back to the pool with the rest when the request ends.
        """
        bs = self.block_size
        table = self._tables.get(req.req_id)
        assert not computed_blocks or (table is None and req.num_computed_tokens == 0), req.req_id
        num_tokens = req.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        assert num_tokens <= req.num_tokens, (req.req_id, num_tokens, req.num_tokens)
        num_tokens += num_lookahead_tokens
        num_held = len(computed_blocks) + (len(table) if table is not None else 0)
        num_needed = cdiv(num_tokens, bs) - num_held
        if num_needed <= 0 and table is not None:
            return []  # the common decode: the token fits in the last block
        num_needed = max(num_needed, 0)
        # Hit blocks that sit in the free queue leave it when touched: they are not allocatable.
        num_hits_in_queue = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_allocatable_blocks - num_hits_in_queue:
            return None
        if table is None:
            table = self._tables[req.req_id] = []
            self._table_ids[req.req_id] = []
            self._num_hashed[req.req_id] = len(computed_blocks)
            self._count_query(req, len(computed_blocks))
        self.pool.touch(computed_blocks)  # before allocate, so hits cannot be evicted by it
        new_blocks = self.pool.allocate(num_needed)
        ids = self._table_ids[req.req_id]
        for block in (*computed_blocks, *new_blocks):
            table.append(block)
            ids.append(block.block_id)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, req: Request) -> None:
        """Offer req's newly full, computed blocks to the prefix cache. Call after each step."""
        if not self.enable_caching or req.req_id not in self._tables:
            return
        start = self._num_hashed[req.req_id]
        end = req.num_computed_tokens // self.block_size
        if end <= start:
            return
        hashes = hash_blocks(req.token_ids, self.block_size, req.block_hashes, end)
        table = self._tables[req.req_id]
        for i in range(start, end):
            self.pool.cache_block(table[i], hashes[i])
        self._num_hashed[req.req_id] = end

    def free(self, req: Request) -> None:
        """Release req's blocks. Tail blocks go first, so they are evicted before the shared prefix."""
        table = self._tables.pop(req.req_id, None)
        if table is None:
            return
        del self._table_ids[req.req_id], self._num_hashed[req.req_id]
        self.pool.free(reversed(table))

    def block_ids(self, req: Request) -> list[int]:
        """req's block table (a copy)."""
        return list(self._table_ids.get(req.req_id, ()))

    def holds(self, req: Request) -> bool:
        return req.req_id in self._tables

    def _count_query(self, req: Request, num_hit_blocks: int) -> None:
        if not self.enable_caching:
            return
        self.num_queries += 1
        self.num_query_tokens += req.num_tokens
        self.num_hits += num_hit_blocks > 0
        self.num_hit_tokens += num_hit_blocks * self.block_size

    def check_integrity(self) -> None:
        """free + used + cached == total, and each ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for req_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            assert ids == self._table_ids[req_id], f"{req_id}: table ids out of sync"
            assert len(set(ids)) == len(ids), f"{req_id}: a block appears twice in its table {ids}"
            assert self._num_hashed[req_id] <= len(table), req_id
            refs.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but held by {refs[block.block_id]} tables"
            )


class ContiguousKVCacheManager:
    """One max_model_len slot per running request: slot i = blocks [i*bps, (i+1)*bps).

    The baseline of paged allocation (`--kv-cache-backend contiguous`). The runner sees an ordinary
    block table (the slot's consecutive block ids), so paged and contiguous share the attention code;
    only the assignment differs. A slot is reserved whole at admission, so a running request never
    needs another block (no decode preemption), and there is no prefix caching.
    Blocks beyond num_slots * bps are unused.
    """

    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.blocks_per_slot = cdiv(max_model_len, self.block_size)
        self.num_slots = self.num_blocks // self.blocks_per_slot
        if self.num_slots == 0:
            raise ValueError(
                f"the contiguous KV cache needs {self.blocks_per_slot} blocks for one max_model_len "
                f"({max_model_len}) slot but has {self.num_blocks}; raise num_blocks or lower max_model_len"
            )
        self.enable_caching = False
        self.max_request_tokens = self.blocks_per_slot * self.block_size
        self._free_slots = list(range(self.num_slots))  # a heap: the lowest free slot is reused first
        self._slots: dict[str, int] = {}
        self.num_queries = self.num_query_tokens = self.num_hits = self.num_hit_tokens = 0
        self.num_evictions = 0
        self.num_cached_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        return len(self._slots) * self.blocks_per_slot

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        return [], 0

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Block] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """The whole slot on the first call (None when no slot is free), nothing new afterwards."""
        assert not computed_blocks
        num_tokens = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        assert num_tokens <= self.max_request_tokens, req.req_id
        if req.req_id in self._slots:
            return []
        if not self._free_slots:
            return None
        slot = heapq.heappop(self._free_slots)
        self._slots[req.req_id] = slot
        return self.block_ids(req)

    def cache_blocks(self, req: Request) -> None:
        pass

    def free(self, req: Request) -> None:
        slot = self._slots.pop(req.req_id, None)
        if slot is not None:
            heapq.heappush(self._free_slots, slot)

    def block_ids(self, req: Request) -> list[int]:
        slot = self._slots.get(req.req_id)
        if slot is None:
            return []
        return list(range(slot * self.blocks_per_slot, (slot + 1) * self.blocks_per_slot))

    def holds(self, req: Request) -> bool:
        return req.req_id in self._slots

    def check_integrity(self) -> None:
        used = sorted(self._slots.values())
        assert len(set(used)) == len(used), f"a slot is held twice: {self._slots}"
        assert sorted(used + self._free_slots) == list(range(self.num_slots)), (used, self._free_slots)


def make_kv_cache_manager(
    cache_config: CacheConfig, max_model_len: int
) -> KVCacheManager | ContiguousKVCacheManager:
    if cache_config.kv_cache_backend == "contiguous":
        return ContiguousKVCacheManager(cache_config, max_model_len)
    return KVCacheManager(cache_config, max_model_len)
