"""AttentionMetadata: a step's packed batch as the attention paths read it, an argument of every model's
`forward`. What the paths need (which sequences go together, their rows, block tables, masks, the
kernels' arguments, scratch buffers) is derived once per forward here, not once per layer.

The model sees a flat batch: `num_tokens` rows from `num_seqs` sequences. Each sequence's new tokens
are the last `query_len` positions of its context of `seq_len` tokens:

    context of seq i:   [ already in the cache : seq_len - query_len | new this step : query_len ]
                          ^ position 0                                 ^ rows query_start .. +query_len

Decoding sequences (query_len == 1) are served together by one batched call per layer (`batch_seqs`),
and so are the step's prefill chunks when padding them to the longest query would waste little
(MAX_PADDED_SCORES: a decode step carrying a small chunk, the common step of chunked prefill) and, where
the prefill kernel serves the step, they are shorter than PREFILL_KERNEL_MIN_QUERY_LEN or their
attention is tiny (SMALL_CHUNK_SCORES); the other sequences (`loop_seqs`: prompts, longer chunks) go
through the prefill kernel, all in one call per layer, or else one at a time through SDPA.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infer.layers import attention_kernels

# A step's short queries (decodes, small prefill chunks) join one batched call over their padded
# contexts when the padding would cost less than this many wasted query x key scores; beyond it, the
# longer ones go one sequence at a time. A per-sequence SDPA call with its gathers and mask costs tens of
# microseconds on a CPU, so a decode step that carries one 8-token chunk is cheaper batched whole.
MAX_PADDED_SCORES = 1 << 16

# Where the prefill kernel serves, a chunk of at least this many tokens goes to it rather than riding
# with the step's decodes in the batched call: from about 8 tokens the prefill kernel's causal skip
# pays; shorter chunks were slower apart, a second kernel call's fixed cost (docs/optimizations.md).
# A shorter query (a verification's) goes to the decode kernel in any step, decodes or not: there its
# rows are computed as lone decodes' are, bit for bit (batched_seqs).
PREFILL_KERNEL_MIN_QUERY_LEN = 8
# ... unless its attention is tiny (query_len x seq_len scores, a short fresh prompt's): microseconds on
# either kernel, and riding lets the step replay a decode graph (infer/runner/decode_graph.py), which
# saves the eager forward's Python (docs/optimizations.md, "Decode graphs").
SMALL_CHUNK_SCORES = 1024


# Rows of a step's flat batch: a run of them as a slice (a view to read, a copy to write), else the
# int64 indices. A mixed step of 2,048 tokens (llama-50m) spent ~5% of its time gathering and
# scattering its prompts' rows by index (index_select, index_put) before runs became slices.
Rows = slice | torch.Tensor


def take_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def put_rows(out: torch.Tensor, rows: Rows, x: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = x
    else:
        out.index_copy_(0, rows, x)


def batched_seqs(
    query_lens: list[int], seq_lens: list[int], key_cache: torch.Tensor, query_dtype=None
) -> list[int]:
    """The sequences of a step that one batched call serves: its decodes, and with them its chunks (where
    the prefill kernel serves, those shorter than PREFILL_KERNEL_MIN_QUERY_LEN or of at most
    SMALL_CHUNK_SCORES scores) when padding them to the longest query would waste at most
    MAX_PADDED_SCORES scores. Where the decode kernel serves, queries shorter than
    PREFILL_KERNEL_MIN_QUERY_LEN (a verification's last token and proposals) are batched whatever the
    rest, decodes or not: the decode kernel computes a query's row as it would a lone decode's, bit for
    bit in bfloat16, where the prefill kernel's or SDPA's arithmetic differs, so greedy speculative
    decoding keeps plain decoding's tokens. Else a step without a decode has none."""
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    if len(decodes) == len(query_lens):
        return decodes
    riders = list(range(len(query_lens)))
    if attention_kernels.decode_kernel_for(key_cache, query_dtype) is not None:
        decodes = [i for i, q in enumerate(query_lens) if q < PREFILL_KERNEL_MIN_QUERY_LEN]
    if attention_kernels.prefill_kernel_for(key_cache, query_dtype) is not None:
        riders = [
            i
            for i, q in enumerate(query_lens)
            if q < PREFILL_KERNEL_MIN_QUERY_LEN or q * seq_lens[i] <= SMALL_CHUNK_SCORES
        ]
    if not decodes or len(decodes) == len(query_lens):
        return decodes
    lens = [query_lens[i] for i in riders]
    block_size = key_cache.shape[1]
    padded_keys = -(-max(seq_lens[i] for i in riders) // block_size) * block_size
    wasted_queries = len(riders) * max(lens) - sum(lens)
    return riders if wasted_queries * padded_keys <= MAX_PADDED_SCORES else decodes


class StepInterrupted(Exception):
    """A forward stopped around a layer's attention because `AttentionMetadata.interrupted` said so: the
    step is to be run again from its start (infer/engine/llm_engine.py, "Interrupted steps")."""


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks_per_seq] int64
    # one (key_cache, value_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    query_dtype: torch.dtype | None = None  # the model's; None: the cache's (an fp8 cache's: bfloat16)
    # asked before and after each layer's attention: True stops the forward there (StepInterrupted)
    interrupted: Callable[[], bool] | None = None
    # derived once per forward (not per layer) in __post_init__
    batch_seqs: list[int] = field(init=False, default_factory=list)  # served by one batched call
    loop_seqs: list[int] = field(init=False, default_factory=list)  # prompts, long chunks: see attention()
    query_starts: list[int] = field(init=False, default_factory=list)
    _batch_keys: dict = field(init=False, default_factory=dict)
    _scratch: dict = field(init=False, default_factory=dict)
    _prefill_masks: dict = field(init=False, default_factory=dict)
    _prefill_blocks: dict = field(init=False, default_factory=dict)
    _kernel_args: tuple | None = field(init=False, default=None)
    _prefill_args: tuple | None = field(init=False, default=None)
    _own_keys_args: tuple | None = field(init=False, default=None)

    @classmethod
    def prefill_only(cls, lens: list[int]) -> AttentionMetadata:
        """Metadata for whole sequences computed from scratch, with no cache."""
        return cls(query_lens=list(lens), seq_lens=list(lens))

    @classmethod
    def static_decode(
        cls, slot_mapping, block_tables, seq_lens: torch.Tensor, query_starts, kv_caches, query_dtype
    ) -> AttentionMetadata:
        """Metadata of a step of the C++ decode kernel's batched call alone, whose per-forward tensors are
        the given ones, for a graph that keeps reading them (infer.runner.decode_graph): the kernel gets
        the whole width of block_tables (a later step may need more of it than this one), seq_lens and
        query_starts (int32) as they are, so that refilling them in place changes what the next replay
        reads. One row per token: a step of fewer sequences (decodes with short chunks) leaves the rest
        without queries and seq_len 0. Captured on a decode step, whose seq_lens the Python lists hold:
        a path other than the kernel's (which the capture then refuses) computes that step right, so
        the capture's run writes the cache as the eager forward did."""
        meta = cls(
            query_lens=[1] * len(seq_lens),
            seq_lens=seq_lens.tolist(),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_caches=kv_caches,
            query_dtype=query_dtype,
        )
        meta.batch_tables = block_tables
        meta._kernel_args = (seq_lens, query_starts)
        return meta

    @classmethod
    def static_verify(
        cls, slot_mapping, block_tables, seq_lens: torch.Tensor, query_len: int, kv_caches, query_dtype
    ) -> AttentionMetadata:
        """Metadata of a step in which every sequence feeds query_len tokens (speculative decoding's
        verification: its last token and the proposals), whose per-forward tensors are the given ones,
        for a graph that keeps reading them (infer.runner.decode_graph). The sequences go where the eager
        forward of such a step sends them (batched_seqs): all to the decode kernel's batched call (queries
        shorter than PREFILL_KERNEL_MIN_QUERY_LEN) or all to the prefill kernel; either gets the whole
        width of block_tables, seq_lens (int32) as they are, and the queries' starts, which query_len
        alone fixes."""
        n = len(seq_lens)
        meta = cls(
            query_lens=[query_len] * n,
            seq_lens=seq_lens.tolist(),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_caches=kv_caches,
            query_dtype=query_dtype,
        )
        starts = torch.arange(0, (n + 1) * query_len, query_len, dtype=torch.int32)
        if meta.batch_seqs:
            assert not meta.loop_seqs, "a step of equal queries is batched whole or not at all"
            meta.batch_tables = block_tables
            meta._kernel_args = (seq_lens, starts)
        else:
            meta._prefill_args = (None, block_tables, seq_lens, starts)
        return meta

    def __post_init__(self):
        assert len(self.query_lens) == len(self.seq_lens)
        assert all(0 < q <= s for q, s in zip(self.query_lens, self.seq_lens, strict=True))
        assert (self.kv_caches is None) == (self.slot_mapping is None) == (self.block_tables is None)
        self.query_starts = list(itertools.accumulate(self.query_lens, initial=0))[:-1]
        if self.kv_caches is None:  # no cache to read a context from: every sequence on its own
            self.loop_seqs = list(range(len(self.query_lens)))
            return
        num_seqs = len(self.query_lens)
        block_size = self.kv_caches[0][0].shape[1]
        self.batch_seqs = batched_seqs(self.query_lens, self.seq_lens, self.kv_caches[0][0], self.query_dtype)
        batched = set(self.batch_seqs)
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
            self.batch_rows = self.rows_of(batch)
        if max_q > 1:
            starts = [self.query_starts[i] for i in batch]
            self.q_rows = torch.tensor(
                [s + min(t, q - 1) for s, q in zip(starts, qlens, strict=True) for t in range(max_q)]
            )
            self.out_rows = torch.tensor([j * max_q + t for j, q in enumerate(qlens) for t in range(q)])
        elif not whole:
            self.q_rows = self.batch_rows
        # One stream over consecutive blocks (the usual single-stream case): its context is a slice of
        # the cache, [first slot, first slot + seq_len), that a float32 matmul reads in place (_stream).
        self.decode_span = None
        if n == 1 and max_q == 1:
            ids = self.batch_tables[0].tolist()
            if ids == list(range(ids[0], ids[0] + num_blocks)):
                self.decode_span = (ids[0] * block_size, self.batch_seq_lens[0])

    def check_interrupted(self) -> None:
        """Raise StepInterrupted if the step's owner wants it stopped."""
        if self.interrupted is not None and self.interrupted():
            raise StepInterrupted

    def batch_keys(self, num_kv_heads: int, sliding_window: int | None):
        """(rows, mask) for the batched sequences' keys under one window, built once per forward.

        Each sequence gathers the keys its queries can see, from the first one its earliest query's
        window reaches (position 0 without a window) to its last, padded to the longest such span:

            seq i's positions:  0 ... first_i ................. seq_len_i - 1
            gathered keys j:          0 ....................... span_i - 1 | padding up to span (masked)

        rows [n, num_kv_heads * span]: for each sequence, its keys' rows of the flat cache view
        [num_slots * num_kv_heads, head_dim] (row slot * num_kv_heads + kv head), kv head by kv head,
        so that one index_select reads them in the [n, num_kv_heads, span, head_dim] order of the
        matmuls. A padding key reads a slot that is there but unused (the rest of the sequence's last
        block, block 0 of a padded table, or its last key again). mask [n, 1, 1, max_q, span] float32:
        0 where a query may attend (its causal context, its window), -inf elsewhere; None when every
        query sees every gathered key (decodes of equal spans, one stream among them)."""
        key = (num_kv_heads, sliding_window)
        if key in self._batch_keys:
            return self._batch_keys[key]
        n, max_q = len(self.batch_seqs), self.max_query_len
        block_size = self.kv_caches[0][0].shape[1]
        seq_lens, query_lens = self.batch_seq_lens, self.batch_query_lens
        firsts = [0] * n
        if sliding_window is not None:
            firsts = [max(0, s - q - sliding_window + 1) for s, q in zip(seq_lens, query_lens, strict=True)]
        spans = [s - f for s, f in zip(seq_lens, firsts, strict=True)]
        span = max(spans)
        heads = torch.arange(num_kv_heads).view(1, -1, 1)  # [1, num_kv_heads, 1]
        if not any(firsts):  # every sequence from position 0: its table's slots, in order
            k_pos = torch.arange(span)  # [span]
            offsets = torch.arange(block_size) * num_kv_heads  # [block_size]
            rows = (self.batch_tables * (block_size * num_kv_heads)).unsqueeze(2) + offsets  # [n, blocks, bs]
            rows = rows.view(n, 1, -1)[:, :, :span] + heads  # [n, num_kv_heads, span]
        else:
            k_pos = torch.tensor(firsts).unsqueeze(1) + torch.arange(span)  # [n, span]
            last = torch.tensor(seq_lens).unsqueeze(1) - 1
            pos = torch.minimum(k_pos, last)  # padding reads the last key again: its block is in the table
            slots = self.batch_tables.gather(1, pos // block_size) * block_size + pos % block_size
            rows = slots.unsqueeze(1) * num_kv_heads + heads  # [n, num_kv_heads, span]
        rows = rows.reshape(n, -1)  # [n, num_kv_heads * span]
        mask = None
        if max_q > 1 or min(spans) < span:
            t = torch.arange(max_q)  # [max_q]
            lens = torch.tensor(query_lens).unsqueeze(1)  # [n, 1]
            starts = torch.tensor(seq_lens).unsqueeze(1) - lens  # [n, 1]: the first query's position
            q_pos = (starts + torch.minimum(t, lens - 1)).unsqueeze(2)  # [n, max_q, 1]
            k_pos = k_pos.unsqueeze(-2)  # [n or 1, 1, span]
            allowed = k_pos <= q_pos  # [n, max_q, span]: a padding key is past the last query
            if sliding_window is not None:
                allowed &= q_pos - k_pos < sliding_window
            mask = torch.where(allowed, 0.0, float("-inf")).view(n, 1, 1, max_q, span)
        self._batch_keys[key] = rows, mask
        return rows, mask

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(seq_lens int32 [n], query_starts int32 [n + 1] or None when every query_len is 1) of the batched
        sequences, for the C++ kernel; built once per forward."""
        if self._kernel_args is None:
            starts = None
            if self.max_query_len > 1:
                starts = list(itertools.accumulate(self.batch_query_lens, initial=0))
                starts = torch.tensor(starts, dtype=torch.int32)
            self._kernel_args = torch.tensor(self.batch_seq_lens, dtype=torch.int32), starts
        return self._kernel_args

    def rows_of(self, seqs: list[int]) -> Rows:
        """Rows of the flat batch that hold sequences `seqs`' queries, in their order: a slice where they
        are one run (the usual mixed step: the scheduler puts decodes first, prompts after), else int64."""
        starts = [self.query_starts[i] for i in seqs]
        ends = [self.query_starts[i] + self.query_lens[i] for i in seqs]
        if starts[1:] == ends[:-1]:
            return slice(starts[0], ends[-1])
        return torch.tensor([self.query_starts[i] + t for i in seqs for t in range(self.query_lens[i])])

    def prefill_kernel_args(self) -> tuple[Rows | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, block_tables, seq_lens, query_starts) of the loop sequences, for the prefill kernel: rows
        of q that are theirs (rows_of; None when they are every row), their block tables, seq_lens int32 [n],
        query_starts int32 [n + 1] of their rows; built once per forward."""
        if self._prefill_args is None:
            seqs = self.loop_seqs
            query_lens = [self.query_lens[i] for i in seqs]
            rows, tables = None, self.block_tables
            if len(seqs) < len(self.query_lens):
                rows, tables = self.rows_of(seqs), self.block_tables[seqs]
            self._prefill_args = (
                rows,
                tables,
                torch.tensor([self.seq_lens[i] for i in seqs], dtype=torch.int32),
                torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32),
            )
        return self._prefill_args

    def own_keys_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_tables, seq_lens, query_starts) for the prefill kernel over a forward without a cache,
        whose keys and values are the step's own rows viewed as blocks of one token
        ([num_tokens, 1, num_kv_heads, head_dim]): sequence i's table lists its rows. The kernel packs
        its tiles token by token whatever the block size, so blocks of one cost it nothing. Built once
        per forward."""
        if self._own_keys_args is None:
            lens = torch.tensor(self.query_lens)
            starts = torch.tensor(self.query_starts)
            tables = torch.arange(max(self.query_lens))[None, :] + starts[:, None]  # [num_seqs, longest]
            tables = torch.minimum(tables, (starts + lens - 1)[:, None])  # past a sequence's end: unread
            self._own_keys_args = (
                tables.contiguous(),
                lens.to(torch.int32),
                torch.tensor(list(itertools.accumulate(self.query_lens, initial=0)), dtype=torch.int32),
            )
        return self._own_keys_args

    def scratch(self, num_rows: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of at least [num_rows, head_dim] for gathered keys and values, shared by every layer
        of this forward: each layer uses them only within its call. Reusing them spares a fresh
        allocation per layer, whose page faults cost more than the gather itself once it is large
        (see attention_reference.GATHER_CHUNK_BYTES)."""
        bufs = self._scratch.get((head_dim, dtype))
        if bufs is None or bufs[0].shape[0] < num_rows:
            bufs = tuple(torch.empty(num_rows, head_dim, dtype=dtype) for _ in range(2))
            self._scratch[(head_dim, dtype)] = bufs
        return bufs

    def prefill_mask(self, i: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """[query_len, seq_len]: where prefill seq i's queries may attend (0, else -inf; True/False
        without a cache); None when SDPA's own causal mask is right (no earlier context, no window in
        reach). Built once per forward, not per layer."""
        key = (i, sliding_window, dtype)
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
            self._prefill_masks[key] = mask if mask is None else self._additive(mask, dtype)
        return self._prefill_masks[key]

    def _additive(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean mask as SDPA would turn it, on every call of every layer, into an additive one (0 / -inf
        in the queries' dtype); done once here. Without a cache: stays boolean."""
        if self.kv_caches is None:
            return mask
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))

    def prefill_blocks(self, i: int) -> torch.Tensor:
        """[num_blocks] the blocks holding prefill seq i's context, in order."""
        if i not in self._prefill_blocks:
            block_size = self.kv_caches[0][0].shape[1]
            self._prefill_blocks[i] = self.block_tables[i, : -(-self.seq_lens[i] // block_size)]
        return self._prefill_blocks[i]
