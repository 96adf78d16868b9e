import pytest

from infer.core.block_hash import ROOT_HASH, hash_block, hash_blocks
from infer.core.block_pool import Block, BlockPool, FreeBlockQueue


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_o1_operations():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])  # from the middle
    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert ids(q) == [1, 3] and len(q) == 2
    q.append(blocks[4])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 0]
    assert q.popleft() is blocks[1]
    assert ids(q) == [3, 4, 0] and len(q) == 3
    with pytest.raises(AssertionError):
        q.append(blocks[3])  # already queued
    for _ in range(3):
        q.popleft()
    with pytest.raises(AssertionError):
        q.popleft()
    with pytest.raises(AssertionError):
        q.remove(blocks[3])  # not queued


def test_hash_chain():
    h0 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h0 == hash_block(ROOT_HASH, (1, 2, 3, 4)) and len(h0) == 16
    h1 = hash_block(h0, [5, 6, 7, 8])
    # Same tokens under another parent: a different hash, so no reuse under a wrong prefix.
    assert h1 != hash_block(hash_block(ROOT_HASH, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert h1 != hash_block(ROOT_HASH, [5, 6, 7, 8])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], extra_keys=("lora-1",)) != h0
    # Token ids are packed at 8 bytes: [1, 256] and [256, 1] (or large ids) cannot alias.
    assert hash_block(ROOT_HASH, [1, 256]) != hash_block(ROOT_HASH, [256, 1])
    assert hash_block(ROOT_HASH, [2**40]) != hash_block(ROOT_HASH, [0])
    hashes = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [], 2)
    assert hashes == [h0, h1]
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, [h0], 2) == [h0, h1]  # extends in place
    with pytest.raises(AssertionError):
        hash_blocks([1, 2, 3], 4, [], 1)  # the block is not full


def test_pool_allocate_free_cache_evict():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_allocatable_blocks == 2 and pool.num_used_blocks == 2
    assert pool.cache_block(a[0], b"h0") and pool.get_cached_block(b"h0") is a[0]
    assert not pool.cache_block(a[1], b"h0")  # duplicate hash: stays uncached
    pool.touch([a[0]])
    assert a[0].ref_cnt == 2
    pool.free(reversed(a))  # 1 -> queue; 0 still referenced
    assert ids(pool.free_queue) == [2, 3, 1] and pool.num_cached_free == 0
    pool.free([a[0]])
    assert ids(pool.free_queue) == [2, 3, 1, 0] and pool.num_cached_free == 1
    pool.check_integrity()
    pool.touch([a[0]])  # a prefix hit on a cached free block takes it out of the queue
    assert ids(pool.free_queue) == [2, 3, 1] and a[0].ref_cnt == 1 and pool.num_cached_free == 0
    pool.free([a[0]])
    got = pool.allocate(3)  # the queue's head, the cached block (its tail) left for last; in id order
    assert ids(got) == [1, 2, 3] and pool.num_evictions == 0 and pool.get_cached_block(b"h0") is a[0]
    got += pool.allocate(1)  # now it is evicted
    assert ids(got) == [1, 2, 3, 0] and pool.num_evictions == 1
    assert pool.get_cached_block(b"h0") is None and got[3].block_hash is None
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.allocate(1)
    pool.free(got)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([got[0]])


def test_a_freed_run_comes_back_in_id_order():
    """Freed tail first, a request's blocks sit in the queue as a reversed run; the next request to take
    them gets them ascending, one run of memory again."""
    pool = BlockPool(8)
    first = pool.allocate(5)
    pool.free(reversed(first))
    rest = pool.allocate(3)  # the never-used blocks 5-7 come first
    again = pool.allocate(5)
    assert ids(rest) == [5, 6, 7] and ids(again) == [0, 1, 2, 3, 4]
    pool.check_integrity()


def test_pool_integrity_catches_corruption():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"x")
    b.block_hash = b"y"
    with pytest.raises(AssertionError):
        pool.check_integrity()
    b.block_hash = b"x"
    pool.check_integrity()
    pool.num_cached_free = 5
    with pytest.raises(AssertionError):
        pool.check_integrity()
