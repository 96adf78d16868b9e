"""The C++ prefill-attention kernel (infer/kernels/prefill_attention.cpp; float_prefill_attention.cpp on a
build without AVX-512 BF16) against a float64 reference:
fresh prompts and chunks over earlier context, lengths around its tile and block sizes, several
sequences of different lengths in one call, GQA, head sizes, sliding windows, scattered blocks; and
through infer.layers.attention, where it serves the sequences that SDPA served one at a time."""

from __future__ import annotations

import os

import pytest
import torch

from infer import kernels
from infer.layers import attention as attention_module
from infer.layers import attention_metadata
from infer.layers.attention_metadata import AttentionMetadata
from tests.grids import pairwise_grid
from tests.models.test_kernels import TOL, _ops, make_step, reference, run_both


def _prefill_ops():
    ops = _ops()
    if ops.isa() == "scalar":
        pytest.skip("the prefill kernel needs AVX2 or AVX-512")
    return ops


def call(ops, q, meta: AttentionMetadata, scale, window):
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(meta.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    key_cache, value_cache = meta.kv_caches[0]
    return ops.prefill_attention(
        q, key_cache, value_cache, meta.block_tables, seq_lens, starts, scale, window or 0
    )


LENGTHS = [1, 15, 17, 63, 64, 65, 200, 1000]
DTYPES = [pytest.param(dtype, id=name) for dtype, name in zip(TOL, ["fp32", "bf16", "fp16"], strict=True)]


def test_tiles_where_the_cpu_has_amx():
    """The build for an AMX CPU runs bf16 prefill attention and the small linears on the tiles ("+amx":
    built with AMX, and the process may use them); elsewhere, or built for another -march, it has none."""
    native = os.environ.get("INFER_KERNELS_MARCH", "native") == "native"
    assert ("+amx" in _prefill_ops().isa()) == (kernels.cpu_has_amx() and native)


@pytest.mark.parametrize(
    "dtype, group, head_dim, window", pairwise_grid(DTYPES, [1, 2, 4], [64, 128], [None, 100])
)
def test_fresh_prompts_one_call(dtype, group, head_dim, window):
    """Every length of LENGTHS a fresh prompt (query_len == seq_len), all in one call."""
    ops = _prefill_ops()
    q, _, _, meta, tables = make_step(2 * group, 2, head_dim, LENGTHS, LENGTHS, dtype, seed=group + head_dim)
    got = call(ops, q, meta, head_dim**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    expected = reference(q, meta, tables, head_dim**-0.5, window)
    torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_prompt(dtype, length):
    ops = _prefill_ops()
    q, _, _, meta, tables = make_step(8, 4, 64, [length], [length], dtype, seed=length)
    got = call(ops, q, meta, 0.125, None)
    torch.testing.assert_close(
        got.double(), reference(q, meta, tables, 0.125, None), atol=TOL[dtype], rtol=TOL[dtype]
    )


# (query_len, seq_len): chunks over earlier context, the last queries of their sequence
CHUNKS = [
    (1, 50),
    (15, 100),
    (17, 17),
    (63, 64),
    (64, 101),
    (65, 130),
    (200, 1000),
    (128, 1999),
    (1000, 1001),
]


@pytest.mark.parametrize("dtype, group, window", pairwise_grid(DTYPES, [1, 2, 4], [None, 7, 100]))
def test_chunks_with_earlier_context(dtype, group, window):
    ops = _prefill_ops()
    query_lens, seq_lens = zip(*CHUNKS, strict=True)
    q, _, _, meta, tables = make_step(2 * group, 2, 64, query_lens, seq_lens, dtype, seed=7 * group)
    got = call(ops, q, meta, 0.125, window)
    expected = reference(q, meta, tables, 0.125, window)
    torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads(threads):
    ops = _prefill_ops()
    q, _, _, meta, tables = make_step(8, 2, 64, [300, 5, 77], [300, 40, 500], torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = call(ops, q, meta, 0.125, None)
    finally:
        torch.set_num_threads(before)
    expected = reference(q, meta, tables, 0.125, None)
    torch.testing.assert_close(got.double(), expected, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
def test_head_shapes(dtype):
    """head_dim 16 to 256 (words of a key not a multiple of 16: 16, 48, 80) and groups up to 8."""
    ops = _prefill_ops()
    for group, head_dim, window in ((1, 16, None), (8, 48, None), (2, 80, 30), (4, 256, None), (3, 96, 65)):
        q, _, _, meta, tables = make_step(2 * group, 2, head_dim, [70, 33], [70, 99], dtype)
        got = call(ops, q, meta, 0.1, window)
        expected = reference(q, meta, tables, 0.1, window)
        torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_large_scores_stay_finite(dtype):
    """Scores in the hundreds (an unscaled product): the online softmax rescales instead of overflowing."""
    ops = _prefill_ops()
    q, _, _, meta, tables = make_step(4, 2, 64, [300], [300], dtype)
    q = q * 20
    got = call(ops, q, meta, 1.0, None)
    assert torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.double(), reference(q, meta, tables, 1.0, None), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
def test_an_earlier_calls_values_do_not_leak_into_a_partial_tile(dtype):
    """The packed tiles live in a buffer kept from call to call: a sequence whose last tile of 64 keys is
    partial must not read the values an earlier call left past its keys (NaN here: 0 x NaN is NaN)."""
    ops = _prefill_ops()
    q, _, _, meta, tables = make_step(4, 2, 64, [64], [64], dtype, seed=1)
    meta.kv_caches[0][1].fill_(float("nan"))
    assert torch.isnan(call(ops, q, meta, 0.125, None)).all()
    q, _, _, meta, tables = make_step(4, 2, 64, [40], [40], dtype, seed=2)
    got = call(ops, q, meta, 0.125, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got.double(), reference(q, meta, tables, 0.125, None), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_bad_arguments_raise():
    ops = _prefill_ops()
    q, _, _, meta, _ = make_step(4, 2, 64, [3, 2], [20, 5], torch.bfloat16)
    key_cache, value_cache = meta.kv_caches[0]
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 3, 5], dtype=torch.int32)
    args = (meta.block_tables, seq_lens, starts, 1.0, 0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.prefill_attention(q, key_cache, value_cache, meta.block_tables + 1000, *args[1:])
    with pytest.raises(RuntimeError, match="too short"):
        ops.prefill_attention(q, key_cache, value_cache, meta.block_tables, seq_lens * 100, *args[2:])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.prefill_attention(q.half(), key_cache, value_cache, *args)
    with pytest.raises(RuntimeError, match="query_starts"):
        ops.prefill_attention(q, key_cache, value_cache, meta.block_tables, seq_lens, starts[:2], 1.0, 0)
    with pytest.raises(RuntimeError, match="query_len"):
        ops.prefill_attention(q, key_cache, value_cache, meta.block_tables, seq_lens - 18, starts, 1.0, 0)


# ---- through infer.layers.attention ----

# name -> (query_lens, seq_lens)
STEPS = {
    "one_prompt": ([300], [300]),
    "prompts": ([65, 1, 200, 17], [65, 1, 200, 17]),
    "chunks": ([64, 150], [200, 150]),
    "decodes_and_a_long_chunk": ([1, 400, 1, 1], [30, 900, 5, 77]),
}


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_attention_serves_loop_seqs(step, dtype, window, monkeypatch):
    _prefill_ops()
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 0)  # the long chunk goes on its own
    query_lens, seq_lens = STEPS[step]
    q, k, v, meta, tables = make_step(8, 2, 64, query_lens, seq_lens, dtype)
    assert meta.loop_seqs
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, meta.kv_caches)
    got, python = run_both(q, k, v, meta_args, 0.125, window, monkeypatch, fallback="sdpa_prefill")
    expected = reference(q, meta, tables, 0.125, window)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), python.double(), atol=2 * tol, rtol=2 * tol)


def test_chunks_of_8_tokens_or_more_leave_the_decodes_for_the_prefill_kernel(monkeypatch):
    """PREFILL_KERNEL_MIN_QUERY_LEN: a chunk that long goes through the prefill kernel, a shorter one still
    rides with the decodes, and so does a longer one of tiny attention (SMALL_CHUNK_SCORES: a fresh
    32-token prompt); without the kernel, all ride (as before it)."""
    _prefill_ops()
    step = ([1, 8, 1, 7, 32, 33], [30, 200, 5, 50, 32, 33])
    _, _, _, meta, _ = make_step(8, 2, 64, *step, torch.bfloat16)
    assert meta.batch_seqs == [0, 2, 3, 4] and meta.loop_seqs == [1, 5]
    monkeypatch.setattr(kernels, "load", lambda: None)
    _, _, _, meta, _ = make_step(8, 2, 64, *step, torch.bfloat16)
    assert meta.batch_seqs == [0, 1, 2, 3, 4, 5] and not meta.loop_seqs


@pytest.mark.parametrize("decodes_first", [False, True], ids=["interleaved", "decodes_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompts_and_long_chunks_take_one_kernel_call(dtype, decodes_first, monkeypatch):
    """Every loop sequence, short or long, in each dtype, goes to the prefill kernel in one call beside the
    batched decodes (SDPA only where the kernel does not serve); every row matches the reference. In the
    scheduler's order (decodes first) both parts' rows are runs, read and written as slices."""
    ops = _prefill_ops()
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 0)
    query_lens, seq_lens = [1, 64, 20, 1, 300, 63], [30, 64, 120, 5, 900, 63]
    if decodes_first:
        order = [0, 3, 1, 2, 4, 5]
        query_lens, seq_lens = [query_lens[i] for i in order], [seq_lens[i] for i in order]
    q, k, v, meta, tables = make_step(8, 2, 64, query_lens, seq_lens, dtype)
    batch, loop = ([0, 1], [2, 3, 4, 5]) if decodes_first else ([0, 3], [1, 2, 4, 5])
    assert meta.batch_seqs == batch and meta.loop_seqs == loop
    rows = meta.prefill_kernel_args()[0]
    assert (meta.batch_rows, rows) == (slice(0, 2), slice(2, 449)) if decodes_first else torch.is_tensor(rows)
    kernel_rows, sdpa_rows = [], []

    class Counting:  # the prefill kernel's calls, by rows
        def prefill_attention(self, q, *args):
            kernel_rows.append(q.shape[0])
            return ops.prefill_attention(q, *args)

    def counting_prefill(q, *args):
        sdpa_rows.append(q.shape[0])
        return prefill(q, *args)

    prefill = attention_module.sdpa_prefill
    monkeypatch.setattr(attention_module, "prefill_kernel", lambda q, cache: Counting())
    monkeypatch.setattr(attention_module, "sdpa_prefill", counting_prefill)
    got = attention_module.attention(q, k, v, meta, 0, 0.125)
    expected = reference(q, meta, tables, 0.125, None)
    torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert kernel_rows == [64 + 20 + 300 + 63] and sdpa_rows == []


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_forward_without_a_cache_takes_one_kernel_call_over_its_own_keys(dtype, window, monkeypatch):
    """Without a cache (a pooling model's forward), every sequence of the step goes to the prefill kernel
    in one call per layer, its keys and values read from the step's own rows, where SDPA took one call
    per sequence; each sequence's rows match SDPA's over its own keys and no key of another is seen."""
    ops = _prefill_ops()
    lens = [65, 1, 200, 17, 128]
    gen = torch.Generator().manual_seed(5)
    n = sum(lens)
    q = torch.randn(n, 8, 64, generator=gen).to(dtype)
    k, v = (torch.randn(n, 2, 64, generator=gen).to(dtype) for _ in range(2))
    meta = AttentionMetadata.prefill_only(lens)
    kernel_calls, sdpa_calls = [], []

    class Counting:
        def prefill_attention(self, q, *args):
            kernel_calls.append(q.shape[0])
            return ops.prefill_attention(q, *args)

    prefill = attention_module.sdpa_prefill
    monkeypatch.setattr(attention_module, "prefill_kernel_for", lambda cache, dtype: Counting())
    monkeypatch.setattr(attention_module, "sdpa_prefill", lambda *a: sdpa_calls.append(1) or prefill(*a))
    got = attention_module.attention(q, k, v, meta, 0, 0.125, window)
    assert kernel_calls == [n] and sdpa_calls == []
    tol = TOL[dtype]
    for i, (start, length) in enumerate(zip(meta.query_starts, lens, strict=True)):
        rows = slice(start, start + length)
        expected = prefill(q[rows], k[rows], v[rows], None, meta, i, 0.125, window)
        torch.testing.assert_close(got[rows].double(), expected.double(), atol=tol, rtol=tol)
