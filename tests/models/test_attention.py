"""The batched attention path (decodes, and small chunks riding along) against a float64 reference:
every query over its causal context, within its window, read back from the paged cache; through the
C++ kernel (infer/kernels) and through the Python path (the matmuls), each. tests/models/test_kernels.py
tests the kernel on its own, on larger shapes."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.layers import attention_kernels, attention_metadata, attention_reference
from infer.layers.attention import attention
from infer.layers.attention_metadata import AttentionMetadata
from tests.grids import pairwise_grid

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4

# name -> (query_lens, seq_lens): one step's sequences
STEPS = {
    "decodes": ([1, 1, 1], [9, 14, 5]),
    "equal_decodes": ([1, 1], [8, 8]),  # no padding: no mask
    "one_stream": ([1], [23]),
    "decodes_and_chunks": ([1, 3, 5, 1], [9, 12, 5, 23]),  # seq 2 is a fresh prompt
}


def make_step(query_lens, seq_lens, dtype, consecutive: bool, seed: int = 0):
    """q, k, v of the step's new tokens, and metadata over a cache already holding random earlier keys."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks)) if consecutive else torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for b in blocks_per_seq:
        tables.append(ids[start : start + b])
        start += b
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    cache = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    slots = [
        tables[i][p // BLOCK] * BLOCK + p % BLOCK
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for p in range(s - q, s)
    ]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    meta = AttentionMetadata(list(query_lens), list(seq_lens), torch.tensor(slots), block_tables, [cache])
    return q, k, v, meta, tables


def reference(q, meta: AttentionMetadata, tables, scale, window):
    """Each sequence's queries over its whole context, read back slot by slot, in float64."""
    key_cache, value_cache = (c.double().view(-1, NUM_KV_HEADS, HEAD_DIM) for c in meta.kv_caches[0])
    out, row = [], 0
    for table, query_len, seq_len in zip(tables, meta.query_lens, meta.seq_lens, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)])
        group = NUM_HEADS // NUM_KV_HEADS
        keys, values = (c[slots].repeat_interleave(group, dim=1) for c in (key_cache, value_cache))
        scores = torch.einsum("qhd,khd->hqk", q[row : row + query_len].double(), keys) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values))
        row += query_len
    return torch.cat(out)


# module constants to override: these tiny steps would otherwise take one chunk, and bfloat16 would be
# converted to float32 for the matmuls
TUNINGS = {
    "as_is": {},
    "own_dtype": {"UPCAST_MAX_KEY_ELEMENTS": 0},
    "own_dtype_chunk_per_seq": {"UPCAST_MAX_KEY_ELEMENTS": 0, "GATHER_CHUNK_BYTES": 1},
}


def use_path(path: str, monkeypatch) -> None:
    """kernel: every batched step through the C++ kernel, chunks too (where it could be built: else this
    is the Python path again); python: the matmuls, as with INFER_NO_KERNELS=1."""
    if path == "kernel":
        monkeypatch.setattr(attention_kernels, "KERNEL_MAX_QUERY_LEN", 1 << 30)
    else:
        monkeypatch.setattr(kernels, "load", lambda: None)


# the tunings are the Python path's: the kernel runs as it is
PATH_TUNINGS = [("kernel", "as_is")] + [("python", tuning) for tuning in sorted(TUNINGS)]


@pytest.mark.parametrize(
    "step, dtype, consecutive, window, path, tuning",
    pairwise_grid(
        sorted(STEPS),
        [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")],
        [pytest.param(False, id="scattered"), pytest.param(True, id="consecutive")],
        [None, 5],
        [pytest.param(*path_tuning, id="-".join(path_tuning)) for path_tuning in PATH_TUNINGS],
    ),
)
def test_batched_attention_matches_reference(step, dtype, consecutive, window, tuning, path, monkeypatch):
    use_path(path, monkeypatch)
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 1 << 30)  # chunks ride in the batch
    for name, value in TUNINGS[tuning].items():
        monkeypatch.setattr(attention_reference, name, value)
    q, k, v, meta, tables = make_step(*STEPS[step], dtype, consecutive)
    assert not meta.loop_seqs
    scale = HEAD_DIM**-0.5
    got = attention(q, k, v, meta, 0, scale, window)
    expected = reference(q, meta, tables, scale, window)
    # float32: exact but for summation order; bfloat16: scores and probabilities rounded to 8 bits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["kernel", "python"])
@pytest.mark.parametrize("consecutive", [False, True], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_decode_batched_beside_a_chunk_on_its_own(dtype, consecutive, path, monkeypatch):
    """The batch is one stream (the in-place path where its blocks are consecutive) while a chunk goes
    through SDPA: the batched path picks its query rows out of the step's."""
    use_path(path, monkeypatch)
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 0)
    # a chunk of 9 tokens: the decode kernel would take a shorter one whatever the padding
    q, k, v, meta, tables = make_step([9, 1], [12, 9], dtype, consecutive)
    assert meta.batch_seqs == [1] and meta.loop_seqs == [0]
    assert (meta.decode_span is not None) == consecutive
    scale = HEAD_DIM**-0.5
    got = attention(q, k, v, meta, 0, scale, 5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference(q, meta, tables, scale, 5), atol=tol, rtol=tol)


def test_mask_only_where_a_query_would_see_padding():
    _, _, _, meta, _ = make_step([1, 1], [8, 8], torch.float32, consecutive=False)
    assert meta.batch_keys(NUM_KV_HEADS, None)[1] is None
    _, _, _, meta, _ = make_step([1, 1], [8, 6], torch.float32, consecutive=False)
    rows, mask = meta.batch_keys(NUM_KV_HEADS, None)
    assert rows.shape == (2, NUM_KV_HEADS * 8) and mask.shape == (2, 1, 1, 1, 8)
    assert mask[1].isinf().sum() == 2  # seq 1's two padding keys
    # a window of 5 gathers each sequence's last 5 keys: equal spans again, no mask
    rows, mask = meta.batch_keys(NUM_KV_HEADS, 5)
    assert rows.shape == (2, NUM_KV_HEADS * 5) and mask is None
