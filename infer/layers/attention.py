"""Attention over a packed batch, reading and writing a block-table KV cache.

The model sees a flat batch: `num_tokens` rows from `num_seqs` sequences. Each sequence's new tokens
are the last `query_len` positions of its context of `seq_len` tokens:

    context of seq i:   [ already in the cache : seq_len - query_len | new this step : query_len ]
                          ^ position 0                                 ^ rows query_start .. +query_len

With a cache, the new keys/values are written to their slots first, and every sequence then attends
over its whole context read back through its block table, except one with no earlier context
(query_len == seq_len: a fresh prompt or first chunk), which reads its new keys directly, as does every
sequence without a cache (a prefill-only forward, the no-cache benchmark mode).

Decoding sequences (query_len == 1) are served together by one batched call per layer, and so are the
step's prefill chunks when padding them to the longest query would waste little (a decode step carrying
a small chunk: the common step of chunked prefill) and, where the prefill kernel serves the step, they
are shorter than PREFILL_KERNEL_MIN_QUERY_LEN; the other sequences (`loop_seqs`: prompts, longer
chunks) go through the prefill kernel, all in one call per layer, or else one at a time through SDPA
(see the end of this docstring).

The batched call is the C++ kernel of infer/kernels (`paged_attention.cpp`, what vLLM's CPU backend has
as cpu_attention_with_kv_cache) wherever it serves the step (KERNEL_MAX_QUERY_LEN, KERNEL_DTYPES, a
head_dim that is a multiple of 16): every query over its context read in place through the block table
(no gathered copy, no padding, no mask), GQA (a kv head's group of query heads reads each key once),
sliding windows, an online float32 softmax, sequences spread over torch's OpenMP threads. It won at
every size measured (2-5x one layer's matmul path), so nothing dispatches by size.

Without the kernel (no compiler, a failed build, INFER_NO_KERNELS=1), the batched call is two matmuls
in the cache's dtype around a float32 softmax (`_matmul_batched`, `_matmuls`): torch's CPU
flash-attention in SDPA is slow in bfloat16 for short queries, while the same memory-bound work as two
bf16 matmuls is not. This path is also the reference the kernel's tests hold it to. Besides the matmuls:
- GQA without repeating K/V: q is viewed [n, kv_heads, group * max_q, D], one matrix per kv head.
- One index_select per K and V, on the flat cache view [num_slots * kv_heads, D], reads only the keys
  some query sees (a sliding window's layers gather the window) in the matmuls' [n, kv_heads, span, D]
  order, into scratch buffers that every layer of a forward reuses, GATHER_CHUNK_BYTES of sequences
  at a time: a fresh buffer per layer page-faults for longer than the gather takes once it is large.
- One stream over consecutive blocks is read in place, a strided view, in float32; small bf16 work
  is converted to float32 (UPCAST_MAX_KEY_ELEMENTS): a bf16 matmul costs ~20 us however small.
bf16 scores are rounded once before the float32 softmax: float32 stays exact (tests/models).

Prefill: the prefill kernel (infer/kernels/prefill_attention.cpp: flash attention's forward over the
paged cache, tiles of 64 keys packed once per call, no tile past the diagonal; with AMX its two products
on the tiles) serves `loop_seqs` wherever it was built with AVX-512 BF16 (`isa()` has "+bf16"), in
PREFILL_KERNEL_DTYPES, for a head_dim that is a multiple of 16; `_prefill`, one SDPA call per sequence,
stays as its fallback (INFER_NO_KERNELS=1, other CPUs, no cache) and the tests' reference. A chunk
riding with decodes goes to the prefill kernel from PREFILL_KERNEL_MIN_QUERY_LEN tokens on: the decode
kernel would compute all its queries against the whole context, with no causal skip.

What each path costs and buys, per layer and per step, with the commands (`benchmarks/bench_attention.py
[--prefill]`): docs/optimizations.md, "C++ attention".
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from infer import kernels

# A step's short queries (decodes, small prefill chunks) join one batched call over their padded
# contexts when the padding would cost less than this many wasted query x key scores; beyond it, the
# longer ones go one sequence at a time. A per-sequence SDPA call with its gathers and mask costs tens of
# microseconds on a CPU, so a decode step that carries one 8-token chunk is cheaper batched whole.
MAX_PADDED_SCORES = 1 << 16

# The batched path gathers the K and V it reads in chunks of sequences of at most this many bytes, into
# scratch buffers that every layer of a forward reuses. 8 MB was the best of 1-32 MB here, 20-40% faster
# than one chunk at 32 x 1024 and beyond, and it bounds the scratch memory.
GATHER_CHUNK_BYTES = 8 << 20

# Below this many key elements (per chunk), bfloat16 keys and values are converted and the matmuls run
# in float32: a bfloat16 matmul on this CPU costs ~20 us however small, a float32 one ~5 us. The best
# of 16K-1M in whole llama-50m decode steps (one stream up to 1024 tokens: up to 0.5 ms a step).
UPCAST_MAX_KEY_ELEMENTS = 1 << 18

# The C++ kernel (infer/kernels) serves the batched call when its longest query is at most this long, in
# these dtypes; the matmuls otherwise (and wherever the kernel is off or could not be built). It won at
# every point measured, chunks of up to 128 tokens riding with decodes included; longer ones, rare in a
# batched call (MAX_PADDED_SCORES), were not measured.
KERNEL_MAX_QUERY_LEN = 128
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The prefill kernel (infer/kernels/prefill_attention.cpp) serves the sequences the batched call leaves
# out (loop_seqs: prompts, longer chunks), all of them in one call per layer, in these dtypes, wherever
# it was built with AVX-512 BF16; SDPA one sequence at a time otherwise (see the module docstring). It
# won at every point measured, in each dtype.
PREFILL_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Where the prefill kernel serves, a chunk of at least this many tokens goes to it rather than riding
# with the step's decodes in the batched call: from about 8 tokens the prefill kernel's causal skip
# pays; shorter chunks were slower apart, a second kernel call's fixed cost (docs/optimizations.md).
PREFILL_KERNEL_MIN_QUERY_LEN = 8

# An fp8 cache (`--kv-cache-dtype fp8`, infer/runner/kv_cache.py): written with each value rounded and
# saturated to the format; read by the kernels as bf16 (bf16 queries, a head_dim of a multiple of 64, a
# build with "+fp8"), else converted to the queries' dtype as the Python paths read it. A fresh prompt's
# own keys go through the same rounding, so that every path attends over what the cache holds.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# Rows of a step's flat batch: a run of them as a slice (a view to read, a copy to write), else the
# int64 indices. A mixed step of 2,048 tokens (llama-50m) spent ~5% of its time gathering and
# scattering its prompts' rows by index (index_select, index_put) before runs became slices.
Rows = slice | torch.Tensor


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: torch.Tensor, rows: Rows, x: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = x
    else:
        out.index_copy_(0, rows, x)


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks_per_seq] int64
    # one (key_cache, value_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    query_dtype: torch.dtype | None = None  # the model's; None: the cache's (an fp8 cache's: bfloat16)
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

    @classmethod
    def prefill_only(cls, lens: list[int]) -> AttentionMetadata:
        """Metadata for whole sequences computed from scratch, with no cache."""
        return cls(query_lens=list(lens), seq_lens=list(lens))

    @classmethod
    def static_decode(
        cls, slot_mapping, block_tables, seq_lens: torch.Tensor, kv_caches, query_dtype
    ) -> AttentionMetadata:
        """Metadata of a decode step (one query per sequence) whose per-forward tensors are the given ones,
        for a graph that keeps reading them (infer.runner.decode_graph): the kernel gets the whole width
        of block_tables (a later step may need more of it than this one) and seq_lens (int32) as they are,
        so that refilling them in place changes what the next replay reads."""
        meta = cls(
            query_lens=[1] * len(seq_lens),
            seq_lens=seq_lens.tolist(),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_caches=kv_caches,
            query_dtype=query_dtype,
        )
        meta.batch_tables = block_tables
        meta._kernel_args = (seq_lens, None)
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
        decodes = [i for i, q in enumerate(self.query_lens) if q == 1]
        if decodes and len(decodes) < num_seqs:
            # the chunks that may ride with the decodes: all, or with the prefill kernel the short ones
            riders = list(range(num_seqs))
            if _prefill_kernel_for(self.kv_caches[0][0], self.query_dtype) is not None:
                riders = [i for i, q in enumerate(self.query_lens) if q < PREFILL_KERNEL_MIN_QUERY_LEN]
            query_lens = [self.query_lens[i] for i in riders]
            padded_keys = -(-max(self.seq_lens[i] for i in riders) // block_size) * block_size
            wasted_queries = len(riders) * max(query_lens) - sum(query_lens)
            if wasted_queries * padded_keys <= MAX_PADDED_SCORES:
                decodes = riders
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

    def scratch(self, num_rows: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of at least [num_rows, head_dim] for gathered keys and values, shared by every layer
        of this forward: each layer uses them only within its call. Reusing them spares a fresh
        allocation per layer, whose page faults cost more than the gather itself once it is large
        (see GATHER_CHUNK_BYTES)."""
        bufs = self._scratch.get((head_dim, dtype))
        if bufs is None or bufs[0].shape[0] < num_rows:
            bufs = tuple(torch.empty(num_rows, head_dim, dtype=dtype) for _ in range(2))
            self._scratch[(head_dim, dtype)] = bufs
        return bufs

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
        in the cache's dtype); done once here. Without a cache, or over an fp8 one, the queries' dtype is
        not known here: stays boolean."""
        dtype = None if self.kv_caches is None else self.kv_caches[0][0].dtype
        if dtype is None or dtype in FP8_DTYPES:  # the queries' dtype is not the cache's
            return mask
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
        ops = kernels.layer_ops(k)
        fp8 = key_cache.dtype in FP8_DTYPES
        same = k.dtype == v.dtype and key_cache.dtype == value_cache.dtype
        same = same and (fp8 or k.dtype == key_cache.dtype)
        dense = key_cache.is_contiguous() and value_cache.is_contiguous()
        dense = dense and key_cache.shape == value_cache.shape
        fast = ops is not None and same and dense and k.stride(-1) == v.stride(-1) == 1
        if fast and (not fp8 or _fp8(ops)):
            ops.write_cache(k, v, key_cache, value_cache, meta.slot_mapping)  # both, one call
        else:  # [num_slots, num_kv_heads, head_dim]
            key_cache.view(-1, *k.shape[1:])[meta.slot_mapping] = _to_cache(k, key_cache.dtype)
            value_cache.view(-1, *v.shape[1:])[meta.slot_mapping] = _to_cache(v, value_cache.dtype)
    if not meta.loop_seqs:  # one batched call covers every row
        return _batched(q, key_cache, value_cache, meta, scale, sliding_window)
    ops = _prefill_kernel(q, cache)
    if ops is not None and not meta.batch_seqs:  # prompts and long chunks: one kernel call
        return _kernel_prefill(ops, q, key_cache, value_cache, meta, scale, sliding_window)
    if ops is None and len(meta.loop_seqs) == 1 and not meta.batch_seqs:  # all the rows are its own
        return _prefill(q, k, v, cache, meta, 0, scale, sliding_window)
    out = torch.empty_like(q)
    if meta.batch_seqs:
        _put(out, meta.batch_rows, _batched(q, key_cache, value_cache, meta, scale, sliding_window))
    if ops is not None:
        rows = meta.prefill_kernel_args()[0]
        _put(out, rows, _kernel_prefill(ops, q, key_cache, value_cache, meta, scale, sliding_window))
        return out
    for i in meta.loop_seqs:
        rows = slice(meta.query_starts[i], meta.query_starts[i] + meta.query_lens[i])
        out[rows] = _prefill(q[rows], k[rows], v[rows], cache, meta, i, scale, sliding_window)
    return out


def _prefill_kernel(q, cache):
    """The kernels' ops where the prefill kernel serves this layer's loop sequences, else None: SDPA."""
    if cache is None or q.stride(-1) != 1:
        return None
    return _prefill_kernel_for(cache[0], q.dtype)


def _reads(ops, q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels take queries of q_dtype over a cache of cache_dtype: of its own dtype, or over
    an fp8 cache bf16 queries with a head_dim of a multiple of 64 on a "+fp8" build."""
    if cache_dtype not in FP8_DTYPES:
        return q_dtype == cache_dtype
    return q_dtype == torch.bfloat16 and head_dim % 64 == 0 and _fp8(ops)


def kernels_read_fp8(q_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this build's kernels read an fp8 cache under queries of q_dtype and this head_dim (else the
    Python path converts what it reads)."""
    ops = kernels.load()
    return ops is not None and _reads(ops, q_dtype, FP8_DTYPES[0], head_dim)


def _prefill_kernel_for(key_cache: torch.Tensor, q_dtype: torch.dtype | None = None):
    """The kernels' ops where the prefill kernel serves queries of q_dtype (None: what the cache takes, bf16
    over fp8) over this cache (PREFILL_KERNEL_DTYPES or fp8, a head_dim that is a multiple of 16, an
    AVX-512 BF16 build, `_reads`), else None."""
    fp8 = key_cache.dtype in FP8_DTYPES
    if (
        (key_cache.dtype not in PREFILL_KERNEL_DTYPES and not fp8)
        or key_cache.device.type != "cpu"
        or key_cache.shape[-1] % 16
    ):
        return None
    ops = kernels.load()
    if ops is None or not _avx512_bf16(ops):
        return None
    q_dtype = q_dtype or (torch.bfloat16 if fp8 else key_cache.dtype)
    return ops if _reads(ops, q_dtype, key_cache.dtype, key_cache.shape[-1]) else None


@functools.cache
def _avx512_bf16(ops) -> bool:
    return "+bf16" in ops.isa()


@functools.cache
def _fp8(ops) -> bool:
    return "+fp8" in ops.isa()


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; into fp8 rounded to nearest and saturated (NaN stays NaN), as the kernels'
    write_cache."""
    if dtype not in FP8_DTYPES:
        return x
    limit = torch.finfo(dtype).max
    return torch.clamp(x.float(), -limit, limit).to(dtype)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as an fp8 cache would give it back (in x's dtype); as it is otherwise."""
    return x if cache_dtype not in FP8_DTYPES else _to_cache(x, cache_dtype).to(x.dtype)


def _kernel_prefill(ops, q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """infer/kernels/prefill_attention.cpp: the loop sequences' queries over their contexts, read from
    the blocks in place, causal tiles only, in one call. Returns their rows [n, H, D] in flat order."""
    rows, tables, seq_lens, query_starts = meta.prefill_kernel_args()
    q = q if rows is None else _take(q, rows)
    return ops.prefill_attention(
        q, key_cache, value_cache, tables, seq_lens, query_starts, scale, sliding_window or 0
    )


def _prefill(q, k, v, cache, meta: AttentionMetadata, i: int, scale, sliding_window):
    """Seq i on its own through SDPA (where the prefill kernel does not serve the layer): its q, k, v rows
    [query_len, H(_kv), D] attend over its context."""
    seq_len = meta.seq_lens[i]
    if cache is None or meta.query_lens[i] == seq_len:  # no context before this step: its own keys suffice
        keys, values = k, v
        if cache is not None:
            keys, values = _as_cached(k, cache[0].dtype), _as_cached(v, cache[1].dtype)
    else:
        blocks = meta.prefill_blocks(i)
        keys = cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        values = cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # from fp8; no copy otherwise
    return _attend(q, keys, values, scale, meta.prefill_mask(i, sliding_window))


def _batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batch's sequences at once: the C++ kernel where it serves them, else the matmuls. Returns the
    batch's real rows [num_batch_tokens, H, D] in their flat order."""
    ops = kernels.load()
    if ops is not None and _kernel_serves(ops, meta, q, key_cache):
        return _kernel_batched(ops, q, key_cache, value_cache, meta, scale, sliding_window)
    return _matmul_batched(q, key_cache, value_cache, meta, scale, sliding_window)


def _kernel_serves(ops, meta: AttentionMetadata, q, key_cache) -> bool:
    return (
        meta.max_query_len <= KERNEL_MAX_QUERY_LEN
        and q.dtype in KERNEL_DTYPES
        and _reads(ops, q.dtype, key_cache.dtype, key_cache.shape[-1])
        and q.device.type == "cpu"
        and q.shape[-1] % 16 == 0
        and q.stride(-1) == 1
    )


def _kernel_batched(ops, q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """infer/kernels/paged_attention.cpp: every batched query over its context, read from the blocks in
    place (no gather, no padding, no mask), split across the threads."""
    q = q if meta.batch_rows is None else _take(q, meta.batch_rows)  # [num_batch_tokens, H, D]
    seq_lens, query_starts = meta.kernel_args()
    return ops.paged_attention(
        q, key_cache, value_cache, meta.batch_tables, seq_lens, query_starts, scale, sliding_window or 0
    )


def _matmul_batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batch's n sequences at once, each query padded to max_q rows, over their gathered keys.
    Returns the batch's real rows [num_batch_tokens, H, D] in their flat order.

    GQA without repeating K/V: the query heads of one kv head (h = kv_head * group + g, as SDPA's
    enable_gqa) and the padded queries of a sequence are the rows of one matrix per kv head."""
    q = q if meta.q_rows is None else _take(q, meta.q_rows)  # [n * max_q, H, D]
    if meta.decode_span is not None:
        small = meta.decode_span[1] * key_cache.shape[2] * key_cache.shape[3] <= UPCAST_MAX_KEY_ELEMENTS
        if key_cache.element_size() >= 4 or small:
            return _stream(q, key_cache, value_cache, meta.decode_span, scale, sliding_window)
    n, max_q = len(meta.batch_seqs), meta.max_query_len
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_q == 1:
        q = q.view(n, num_kv_heads, group, head_dim)
    else:
        q = q.view(n, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [n, H_kv, g, max_q, D]
        q = q.reshape(n, num_kv_heads, group * max_q, head_dim)
    rows, mask = meta.batch_keys(num_kv_heads, sliding_window)  # [n, H_kv * span], [n, 1, 1, max_q, span]
    # sequences per chunk: the gathered keys and values of one chunk take at most GATHER_CHUNK_BYTES (an
    # fp8 cache's, once converted to q's dtype)
    size = max(key_cache.element_size(), q.element_size())
    chunk = max(1, GATHER_CHUNK_BYTES // (2 * rows.shape[1] * head_dim * size))
    buffers = meta.scratch(min(n, chunk) * rows.shape[1], head_dim, key_cache.dtype)
    caches = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)  # [num_slots * H_kv, D]
    if n <= chunk:
        out = _gathered(q, caches, rows.view(-1), mask, buffers, scale)  # [n, H_kv, group * max_q, D]
    else:
        out = q.new_empty(q.shape)
        for start in range(0, n, chunk):
            seqs = slice(start, start + chunk)
            part = mask if mask is None else mask[seqs]
            out[seqs] = _gathered(q[seqs], caches, rows[seqs].flatten(), part, buffers, scale)
    if max_q == 1:
        return out.view(n, num_heads, head_dim)
    out = out.view(n, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [n, max_q, H_kv, g, D]
    out = out.reshape(n * max_q, num_heads, head_dim)  # [n * max_q, H, D]
    return out if meta.out_rows is None else out.index_select(0, meta.out_rows)


def _stream(q, key_cache, value_cache, decode_span, scale, sliding_window):
    """One stream decoding over consecutive blocks, in float32 (or wider): the matmuls read its keys in
    place, a strided view of the cache, as fast as SDPA did and faster than a gather would be. A short
    bfloat16 context is converted first (see UPCAST_MAX_KEY_ELEMENTS); a longer one takes _gathered,
    since a bfloat16 matmul is 2-3x slower on the strided layout than a gather and a matmul."""
    dtype = q.dtype
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    first_slot, seq_len = decode_span
    if sliding_window is not None and seq_len > sliding_window:
        first_slot, seq_len = first_slot + seq_len - sliding_window, sliding_window
    keys, values = (  # [H_kv, seq_len, D]
        c.view(-1, num_kv_heads, head_dim)[first_slot : first_slot + seq_len].transpose(0, 1)
        for c in (key_cache, value_cache)
    )
    q, keys, values = (_widen(x) for x in (q.view(num_kv_heads, -1, head_dim), keys, values))
    scores = torch.matmul(q, keys.transpose(1, 2)).mul_(scale)  # [H_kv, group, seq_len]
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [H_kv, group, D]
    return out.view(1, num_heads, head_dim).to(dtype)


def _widen(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 or float16 to float32; float32 and float64 as they are."""
    return x.float() if x.element_size() < 4 else x


def _gathered(q, caches, rows, mask, buffers, scale):
    """m sequences' queries q [m, H_kv, group * max_q, D] over their keys and values, gathered by rows
    [m * H_kv * span] from the flat caches [num_slots * H_kv, D] into the scratch buffers."""
    shape = (q.shape[0], q.shape[1], -1, q.shape[3])  # [m, H_kv, span, D]
    keys, values = (
        torch.index_select(cache, 0, rows, out=buf[: len(rows)]).view(shape).to(q.dtype)  # from fp8
        for cache, buf in zip(caches, buffers, strict=True)
    )
    return _matmuls(q, keys, values, mask, scale)


def _matmuls(q, keys, values, mask, scale):
    """q [m, H_kv, group * max_q, D] over keys, values [m, H_kv, span, D]: two matmuls in q's dtype
    (the cache's, or what an fp8 cache's became) around a float32 softmax (see the module docstring for
    why not SDPA). mask: None, or [m, 1, 1, max_q, span] float32, 0 or -inf."""
    if keys.element_size() < 4 and keys.numel() <= UPCAST_MAX_KEY_ELEMENTS:
        return _matmuls(q.float(), keys.float(), values.float(), mask, scale).to(q.dtype)
    m, num_kv_heads, num_queries, _ = q.shape
    scores = torch.matmul(q, keys.transpose(2, 3))  # [m, H_kv, group * max_q, span] in the cache's dtype
    if mask is None:
        scores = _widen(scores).mul_(scale)
    else:  # float32 out: the add converts bfloat16 scores on the fly
        max_q, span = mask.shape[3:]
        scores = torch.add(mask, scores.view(m, num_kv_heads, -1, max_q, span), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(m, num_kv_heads, num_queries, -1)
    return torch.matmul(probs, values)


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
