"""The pool of KV blocks: ref counts, the prefix-cache map, and an O(1) LRU free queue.

Every block is in exactly one of three states:

    used    ref_cnt > 0                      held by one or more block tables (not in the free queue)
    cached  ref_cnt == 0, block_hash set     in the free queue, still findable by hash (evictable)
    free    ref_cnt == 0, no hash            in the free queue, holding nothing useful

    used + cached + free == num_blocks

The free queue is ordered by eviction priority: allocation pops the head (and hands a call's blocks out
in id order, not the queue's: see `allocate`), freeing appends to the tail, so an unreferenced cached
block survives as long as possible (LRU). A cached block is evicted lazily: only when allocation pops
it, at which point its hash is dropped. A prefix hit on a cached block takes it out of the middle of the
queue in O(1) (`touch`), which is why the queue is a hand-made doubly linked list through the blocks
themselves rather than a deque.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from infer.core.block_hash import BlockHash


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None  # links, meaningful only while in the free queue
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: no None checks on the hot path
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_blocks

    def popleft(self) -> Block:
        block = self._head.next_free
        assert block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def append(self, block: Block) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the queue"
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_blocks += 1

    def __iter__(self) -> Iterator[Block]:
        """Blocks in eviction order (next to be allocated first). For tests and integrity checks."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns all blocks. Callers hold references through `touch`/`allocate` and give them back with `free`."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)  # ordered by block id at start
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, Block] = {}  # hash -> block, used or cached
        self.num_cached_free = 0  # blocks in the free queue that still have a hash
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached (evictable) ones."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue, evicting cached ones; each gets ref_cnt 1.
        Returned in block-id order, whatever their order in the queue: freed tail first, a request's
        blocks come back as a reversed run, and the attention kernels stream a sequence's blocks in
        table order, faster where consecutive blocks are consecutive memory.

        Caller checks `n <= num_allocatable_blocks` first (asserted).
        """
        assert n <= len(self.free_queue), f"allocate({n}) with only {len(self.free_queue)} free blocks"
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # lazy eviction of an unreferenced cached block
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_cached_free -= 1
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda block: block.block_id)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (prefix hit); cached-free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= 1  # only cached blocks are found by hash
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the given order: the first to reach 0 is evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Make a used, full block findable by hash. False when another block already holds this hash
        (two requests computed the same prefix at once): the block then stays uncached."""
        assert block.ref_cnt > 0 and block.block_hash is None, block
        if not self.enable_caching or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError if the three states, the queue links or the hash map disagree."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_blocks, (len(in_queue), self.free_queue.num_blocks)
        queued_ids = {b.block_id for b in in_queue}
        assert len(queued_ids) == len(in_queue), "a block appears twice in the free queue"
        num_used = num_cached = num_free = 0
        for block in self.blocks:
            queued = block.block_id in queued_ids
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == queued, f"{block}: ref_cnt 0 <=> in free queue, queued={queued}"
            if block.ref_cnt > 0:
                num_used += 1
            elif block.block_hash is not None:
                num_cached += 1
            else:
                num_free += 1
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} has a hash the map lacks"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"map entry {block_hash.hex()} -> {block}"
        assert num_used + num_cached + num_free == self.num_blocks, (num_used, num_cached, num_free)
        assert num_cached == self.num_cached_free, (num_cached, self.num_cached_free)
