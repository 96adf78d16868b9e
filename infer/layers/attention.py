"""Attention over a packed batch, reading and writing a block-table KV cache.

The model sees a flat batch: `num_tokens` rows from `num_seqs` sequences. Each sequence's new tokens
are the last `query_len` positions of its context of `seq_len` tokens:

    context of seq i:   [ already in the cache : seq_len - query_len | new this step : query_len ]
                          ^ position 0                                 ^ rows query_start .. +query_len

With a cache, the new keys/values are written to their slots first, and every sequence then attends
over its whole context read back through its block table, except one with no earlier context
(query_len == seq_len: a fresh prompt or first chunk), which reads its new keys directly, as does every
sequence without a cache (a prefill-only forward, the no-cache benchmark mode).

Decoding sequences (query_len == 1) are served together by one SDPA call per layer over their
gathered, padded contexts, and so are the step's prefill chunks when padding them to the longest query
wastes little (a decode step carrying a small chunk: the common step of chunked prefill); otherwise
prefill chunks, fewer and longer, go one sequence at a time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# A step's short queries (decodes, small prefill chunks) join one batched SDPA over their padded
# contexts when the padding would cost less than this many wasted query x key scores; beyond it, the
# longer ones go one sequence at a time. A per-sequence SDPA call with its gathers and mask costs tens of
# microseconds on a CPU, so a decode step that carries one 8-token chunk is cheaper batched whole.
MAX_PADDED_SCORES = 1 << 16


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks_per_seq] int64
    # one (key_cache, value_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # derived once per forward (not per layer) in __post_init__
    batch_seqs: list[int] = field(init=False, default_factory=list)  # served by one batched SDPA
    loop_seqs: list[int] = field(init=False, default_factory=list)  # served one at a time
    query_starts: list[int] = field(init=False, default_factory=list)
    _batch_masks: dict = field(init=False, default_factory=dict)
    _prefill_masks: dict = field(init=False, default_factory=dict)
    _prefill_blocks: dict = field(init=False, default_factory=dict)

    @classmethod
    def prefill_only(cls, lens: list[int]) -> AttentionMetadata:
        """Metadata for whole sequences computed from scratch, with no cache."""
        return cls(query_lens=list(lens), seq_lens=list(lens))

    def __post_init__(self):
        assert len(self.query_lens) == len(self.seq_lens)
        assert all(0 < q <= s for q, s in zip(self.query_lens, self.seq_lens, strict=True))
        assert (self.kv_caches is None) == (self.slot_mapping is None) == (self.block_tables is None)
        self.query_starts = list(itertools.accumulate(self.query_lens, initial=0))[:-1]
        if self.kv_caches is None:  # no cache to read a context from: every sequence on its own
            self.loop_seqs = list(range(len(self.query_lens)))
            return
        num_seqs, num_tokens = len(self.query_lens), sum(self.query_lens)
        block_size = self.kv_caches[0][0].shape[1]
        decodes = [i for i, q in enumerate(self.query_lens) if q == 1]
        if decodes and len(decodes) < num_seqs:
            padded_keys = -(-max(self.seq_lens) // block_size) * block_size
            wasted_queries = num_seqs * max(self.query_lens) - num_tokens
            if wasted_queries * padded_keys <= MAX_PADDED_SCORES:
                decodes = list(range(num_seqs))
        self.batch_seqs = decodes
        batched = set(decodes)
        self.loop_seqs = [i for i in range(num_seqs) if i not in batched]
        if not self.batch_seqs:
            return
        # Built from the Python lists: a handful of tiny tensor ops would cost more.
        batch, n = self.batch_seqs, len(self.batch_seqs)
        qlens = [self.query_lens[i] for i in batch]
        self.batch_seq_lens = [self.seq_lens[i] for i in batch]
        self.batch_query_lens = qlens
        self.max_query_len = max_q = max(qlens)
        num_blocks = -(-max(self.batch_seq_lens) // block_size)
        whole = n == num_seqs  # the batch is every row of the step, in order
        tables = self.block_tables if whole else self.block_tables[batch]
        self.batch_tables = tables[:, :num_blocks]  # [n, num_blocks]
        # rows of q to gather into [n, max_q] (a padding row repeats its sequence's last query), and the
        # rows of the padded output that are real, in the flat order of the batch's rows
        self.q_rows = self.out_rows = self.batch_rows = None
        if not whole:
            self.batch_rows = torch.tensor(
                [self.query_starts[i] + t for i in batch for t in range(self.query_lens[i])]
            )
        if max_q > 1:
            starts = [self.query_starts[i] for i in batch]
            self.q_rows = torch.tensor(
                [s + min(t, q - 1) for s, q in zip(starts, qlens, strict=True) for t in range(max_q)]
            )
            self.out_rows = torch.tensor([j * max_q + t for j, q in enumerate(qlens) for t in range(q)])
        elif not whole:
            self.q_rows = self.batch_rows
        # One stream over consecutive blocks (the usual single-stream case) reads its context as a
        # view of the cache: no per-step copy that grows with the context.
        self.decode_span = None
        if n == 1 and max_q == 1:
            ids = self.batch_tables[0].tolist()
            if ids == list(range(ids[0], ids[0] + num_blocks)):
                self.decode_span = (ids[0] * block_size, self.batch_seq_lens[0])

    def batch_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[n, 1, max_q, padded_len]: 0 where a batched query may attend (its causal context, its
        window), -inf elsewhere."""
        if sliding_window not in self._batch_masks:
            padded = self.batch_tables.shape[1] * self.kv_caches[0][0].shape[1]
            k_pos = torch.arange(padded)  # [padded_len]
            t = torch.arange(self.max_query_len)  # [max_q]
            seq_lens = torch.tensor(self.batch_seq_lens).unsqueeze(1)  # [n, 1]
            query_lens = torch.tensor(self.batch_query_lens).unsqueeze(1)
            q_pos = seq_lens - query_lens + torch.minimum(t, query_lens - 1)  # [n, max_q]
            q_pos = q_pos.unsqueeze(2)  # [n, max_q, 1]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= q_pos - k_pos < sliding_window
            self._batch_masks[sliding_window] = self._additive(mask.unsqueeze(1))
        return self._batch_masks[sliding_window]

    def prefill_mask(self, i: int, sliding_window: int | None) -> torch.Tensor | None:
        """[query_len, seq_len]: where prefill seq i's queries may attend (0, else -inf; True/False
        without a cache); None when SDPA's own causal mask is right (no earlier context, no window in
        reach). Built once per forward, not per layer."""
        key = (i, sliding_window)
        if key not in self._prefill_masks:
            query_len, seq_len = self.query_lens[i], self.seq_lens[i]
            windowed = sliding_window is not None and seq_len > sliding_window
            mask = None
            if query_len < seq_len or windowed:
                q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)  # [query_len, 1]
                k_pos = torch.arange(seq_len).unsqueeze(0)  # [1, seq_len]
                mask = k_pos <= q_pos
                if windowed:
                    mask &= q_pos - k_pos < sliding_window
            self._prefill_masks[key] = mask if mask is None else self._additive(mask)
        return self._prefill_masks[key]

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA would turn it, on every call of every layer, into an additive one (0 / -inf
        in the cache's dtype); done once here. Without a cache the dtype is unknown: stays boolean."""
        if self.kv_caches is None:
            return mask
        dtype = self.kv_caches[0][0].dtype
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))

    def prefill_blocks(self, i: int) -> torch.Tensor:
        """[num_blocks] the blocks holding prefill seq i's context, in order."""
        if i not in self._prefill_blocks:
            block_size = self.kv_caches[0][0].shape[1]
            self._prefill_blocks[i] = self.block_tables[i, : -(-self.seq_lens[i] // block_size)]
        return self._prefill_blocks[i]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    cache = meta.kv_caches[layer_idx] if meta.kv_caches is not None else None
    if cache is not None:
        key_cache, value_cache = cache
        key_cache.view(-1, *k.shape[1:])[meta.slot_mapping] = k  # [num_slots, num_kv_heads, head_dim]
        value_cache.view(-1, *v.shape[1:])[meta.slot_mapping] = v
    if not meta.loop_seqs:  # one batched call covers every row
        return _batched(q, key_cache, value_cache, meta, scale, sliding_window)
    if len(meta.loop_seqs) == 1 and not meta.batch_seqs:  # one prompt or chunk: all the rows are its own
        return _prefill(q, k, v, cache, meta, 0, scale, sliding_window)
    out = torch.empty_like(q)
    if meta.batch_seqs:
        out[meta.batch_rows] = _batched(q, key_cache, value_cache, meta, scale, sliding_window)
    for i in meta.loop_seqs:
        rows = slice(meta.query_starts[i], meta.query_starts[i] + meta.query_lens[i])
        out[rows] = _prefill(q[rows], k[rows], v[rows], cache, meta, i, scale, sliding_window)
    return out


def _prefill(q, k, v, cache, meta: AttentionMetadata, i: int, scale, sliding_window):
    """Seq i on its own: its q, k, v rows [query_len, H(_kv), D] attend over its context."""
    seq_len = meta.seq_lens[i]
    if cache is None or meta.query_lens[i] == seq_len:  # no context before this step: its own keys suffice
        keys, values = k, v
    else:
        blocks = meta.prefill_blocks(i)
        keys = cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        values = cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
    return _attend(q, keys, values, scale, meta.prefill_mask(i, sliding_window))


def _batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batch's n sequences at once, each query padded to max_q rows, over their padded contexts.
    Returns the batch's real rows [num_batch_tokens, H, D] in their flat order."""
    n, max_q = len(meta.batch_seqs), meta.max_query_len
    q = q if meta.q_rows is None else q.index_select(0, meta.q_rows)  # [n * max_q, H, D]
    if n == 1 and max_q == 1:  # one stream: exactly its context, so neither padding nor a mask
        seq_len = meta.batch_seq_lens[0]
        if meta.decode_span is not None:  # consecutive blocks: a view of the cache, no copy
            start = meta.decode_span[0]
            keys, values = (c.flatten(0, 1)[start : start + seq_len] for c in (key_cache, value_cache))
        else:  # scattered blocks (a prefix-cache hit, a reused pool): one gather of its own blocks
            blocks = meta.batch_tables[0]
            keys, values = (
                c.index_select(0, blocks).flatten(0, 1)[:seq_len] for c in (key_cache, value_cache)
            )
        if sliding_window is not None and seq_len > sliding_window:
            keys, values = keys[-sliding_window:], values[-sliding_window:]
        keys, values = (x.permute(1, 0, 2).unsqueeze(0) for x in (keys, values))  # [1, H_kv, seq_len, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)
        return out.squeeze(2)
    # index_select on the flat table, then a view: one gather, ~2x cheaper than indexing with the 2-D table
    shape = (n, -1, *key_cache.shape[2:])  # [n, padded_len, H_kv, head_dim]
    keys = key_cache.index_select(0, meta.batch_tables.flatten()).view(shape)
    values = value_cache.index_select(0, meta.batch_tables.flatten()).view(shape)
    out = F.scaled_dot_product_attention(
        q.view(n, max_q, *q.shape[1:]).transpose(1, 2),  # [n, H, max_q, D]
        keys.transpose(1, 2),  # [n, H_kv, padded_len, D]
        values.transpose(1, 2),
        attn_mask=meta.batch_mask(sliding_window),
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(n * max_q, *q.shape[1:])  # [n * max_q, H, D]
    return out if meta.out_rows is None else out.index_select(0, meta.out_rows)


def _attend(q, k, v, scale, mask):
    """One sequence: q [query_len, H, D] attends over k, v [seq_len, H_kv, D] under mask (None: causal)."""
    # [1, heads, len, head_dim]: 4-D inputs get the CPU flash kernel; 3-D ones fall back to the math path,
    # 2-3x slower for short sequences (15 vs 47 us for a causal 8-token prompt with 4 heads of 8)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [query_len, heads, head_dim]
