"""Chained hashes of full KV blocks, the keys of the prefix cache.

    tokens:  [ t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 ]     block_size = 16
    hashes:     h0 = H(ROOT, t0..t15)
                            h1 = H(h0, t16..t31)
                                         h2 = H(h1, t32..t47)      (the partial last block has none)

A block's hash covers its own tokens *and* every token before it (through the parent hash), so equal
hashes mean equal prefixes: a block is never reused under a different prefix.

Why blake2b-128 and not Python's `hash()`: the cache maps hash -> KV block, so a collision silently
serves another prompt's KV (wrong output, and a cross-user leak when an attacker can choose prompts).
`hash()` of a tuple of ints is 64-bit, not collision resistant (ints hash to themselves modulo 2**61-1)
and easy to collide on purpose. blake2b is cryptographic, in the standard library, faster than sha256
in CPython, and costs ~1 microsecond per 16-token block: a 1024-token prompt hashes in ~0.1 ms, once.
128 bits keep accidental collisions negligible (birthday bound ~2**64 blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = b"infer-prefix-root"


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block from its parent's hash, its token ids and optional extra keys.

    extra_keys: anything besides the tokens that changes the KV of the block (a LoRA adapter id, an
    image hash); their `repr` is hashed, so use ints and strings.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())  # 8 bytes per id: any vocabulary fits, no ambiguity
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    hashes: list[BlockHash],
    num_blocks: int,
    extra_keys: tuple = (),
) -> list[BlockHash]:
    """Extend `hashes` (the chain of the first len(hashes) blocks) in place to `num_blocks` blocks.

    Invariant: blocks 0 .. num_blocks-1 of token_ids are full (num_blocks * block_size <= len).
    Returns `hashes` for convenience.
    """
    assert num_blocks * block_size <= len(token_ids), (num_blocks, block_size, len(token_ids))
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
