import pytest

from infer.config import CacheConfig
from infer.core.kv_cache_manager import ContiguousKVCacheManager, KVCacheManager, make_kv_cache_manager
from infer.core.request import Request


def manager(num_blocks=8, block_size=4, caching=True):
    cfg = CacheConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching)
    return KVCacheManager(cfg, max_model_len=64)


def admit(kv, req, num_new=None):
    """Look up the prefix, allocate the rest of the prompt, pretend it was computed, cache it."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new_ids = kv.allocate_slots(req, num_new, hits)
    assert new_ids is not None
    req.num_computed_tokens = num_hit + num_new
    kv.cache_blocks(req)
    kv.check_integrity()
    return [b.block_id for b in hits], new_ids


def refs(kv):
    return [b.ref_cnt for b in kv.pool.blocks]


def queue(kv):
    return [b.block_id for b in kv.pool.free_queue]


def test_exact_block_ids_as_a_sequence_grows():
    kv = manager()
    a = Request("a", list(range(10)))
    assert admit(kv, a) == ([], [0, 1, 2])
    assert [b.block_hash is not None for b in kv.pool.blocks[:3]] == [True, True, False]  # 10 // 4 full
    for token, expect_new in [(50, []), (51, []), (52, [3])]:  # decode: 11, 12, 13 tokens
        a.append_output_token(token, now=0.0)
        assert kv.allocate_slots(a, 1) == expect_new
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
    assert kv.block_ids(a) == [0, 1, 2, 3] and kv.pool.blocks[2].block_hash is not None
    assert (kv.num_used_blocks, kv.num_cached_blocks, kv.num_free_blocks, kv.usage) == (4, 0, 4, 0.5)
    kv.check_integrity()


def test_hash_chain_reuse_and_divergence():
    kv = manager()
    a = Request("a", list(range(12)))
    admit(kv, a)
    b = Request("b", list(range(8)) + [99, 98, 97, 96, 5])
    assert admit(kv, b) == ([0, 1], [3, 4])  # 2 shared blocks, then its own
    assert refs(kv)[:5] == [2, 2, 1, 1, 1]
    assert kv.block_ids(b) == [0, 1, 3, 4]
    assert b.block_hashes[:2] == a.block_hashes[:2] and b.block_hashes[2] != a.block_hashes[2]
    assert (kv.num_queries, kv.num_query_tokens, kv.num_hits, kv.num_hit_tokens) == (2, 25, 1, 8)
    kv.free(a)
    assert refs(kv)[:5] == [1, 1, 0, 1, 1] and queue(kv) == [5, 6, 7, 2]
    kv.free(b)
    assert refs(kv) == [0] * 8
    # b's tail goes first, then the shared prefix (its last holder was b): LRU = tail blocks first.
    assert queue(kv) == [5, 6, 7, 2, 4, 3, 1, 0]
    kv.check_integrity()


def test_last_prompt_token_is_always_recomputed():
    kv = manager()
    admit(kv, Request("a", list(range(8))))  # 2 full blocks, both cached
    c = Request("c", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert [b.block_id for b in hits] == [0] and num_hit == 4  # block 1 holds the last token
    assert kv.allocate_slots(c, 4, hits) == [2]


def test_lru_eviction_order_and_eviction_when_free_list_is_empty():
    kv = manager(num_blocks=6)
    a, b = Request("a", list(range(8))), Request("b", list(range(20, 28)))
    admit(kv, a), admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert queue(kv) == [4, 5, 1, 0, 3, 2]
    assert (kv.num_used_blocks, kv.num_cached_blocks, kv.num_free_blocks, kv.usage) == (0, 4, 2, 0.0)
    c = Request("c", list(range(40, 52)))
    # two free blocks, then the LRU cached one (a's tail); a table holds new blocks in id order
    assert admit(kv, c) == ([], [1, 4, 5])
    assert kv.num_evictions == 1 and kv.pool.get_cached_block(a.block_hashes[1]) is None
    a2 = Request("a2", list(range(8)) + [7])
    # a's first block survived, its second was evicted: hit [0], then the LRU cached blocks 3 and 2 (b's).
    assert admit(kv, a2) == ([0], [2, 3])
    assert kv.num_evictions == 3 and queue(kv) == [] and kv.usage == 1.0
    d = Request("d", list(range(60, 65)))
    assert kv.allocate_slots(d, 5) is None  # everything is referenced: nothing to evict
    kv.free(c)
    assert queue(kv) == [5, 4, 1]  # tail first
    assert admit(kv, d) == ([], [4, 5])
    assert kv.num_evictions == 5
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = manager(num_blocks=4)
    a = Request("a", list(range(12)))
    admit(kv, a)
    b = Request("b", list(range(50, 58)))
    before = (queue(kv), refs(kv), kv.num_queries)
    assert kv.allocate_slots(b, 8) is None
    assert (queue(kv), refs(kv), kv.num_queries) == before and not kv.holds(b) and kv.block_ids(b) == []
    kv.check_integrity()


def test_hits_waiting_in_the_free_queue_are_not_counted_twice():
    kv = manager(num_blocks=4)
    a = Request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert (kv.num_cached_blocks, kv.num_free_blocks) == (2, 2)
    too_long = Request("x", list(range(8)) + list(range(30, 42)))  # 20 tokens = 5 blocks > 4
    hits, num_hit = kv.get_computed_blocks(too_long)
    assert num_hit == 8 and kv.allocate_slots(too_long, 12, hits) is None
    assert refs(kv) == [0, 0, 0, 0]
    b = Request("b", list(range(8)) + list(range(30, 38)))  # 16 tokens: 2 hits + 2 new = the whole pool
    assert admit(kv, b) == ([0, 1], [2, 3])
    assert kv.num_evictions == 0 and kv.usage == 1.0


def test_integrity_check_detects_corruption():
    kv = manager()
    a = Request("a", list(range(8)))
    admit(kv, a)
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="held by 1 tables"):
        kv.check_integrity()
    kv.pool.blocks[0].ref_cnt -= 1
    kv._tables["a"].append(kv._tables["a"][0])
    kv._table_ids["a"].append(0)
    with pytest.raises(AssertionError, match="appears twice"):
        kv.check_integrity()


def test_prefix_caching_off():
    kv = manager(caching=False)
    a = Request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)
    assert a.block_hashes == [] and kv.num_cached_blocks == 0 and kv.num_queries == 0
    kv.check_integrity()


def test_contiguous_slots():
    cfg = CacheConfig(num_blocks=10, block_size=4, kv_cache_backend="contiguous")
    kv = make_kv_cache_manager(cfg, max_model_len=10)
    assert isinstance(kv, ContiguousKVCacheManager)
    assert (kv.blocks_per_slot, kv.num_slots, kv.max_request_tokens) == (3, 3, 12)
    reqs = [Request(name, [1, 2, 3]) for name in "abcd"]
    assert [kv.allocate_slots(r, 3) for r in reqs] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], None]
    assert kv.get_computed_blocks(reqs[0]) == ([], 0)
    reqs[0].num_computed_tokens = 3
    assert kv.allocate_slots(reqs[0], 1) == []  # a running request never needs more
    assert (kv.num_used_blocks, kv.num_free_blocks, kv.usage) == (9, 1, 0.9)
    kv.free(reqs[1])
    kv.free(reqs[1])  # idempotent
    assert kv.allocate_slots(reqs[3], 3) == [3, 4, 5]  # the freed slot
    assert kv.block_ids(reqs[3]) == [3, 4, 5] and kv.block_ids(reqs[1]) == []
    kv.check_integrity()
    with pytest.raises(ValueError, match="needs 3 blocks for one max_model_len"):
        make_kv_cache_manager(CacheConfig(num_blocks=2, block_size=4, kv_cache_backend="contiguous"), 10)
