"""The C++ paged-attention kernel (infer/kernels) against a float64 reference and the Python path it
replaces, its other ISAs (AVX2, plain C++) built beside the host's, and the loader's fallbacks."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from infer import kernels
from infer.layers import attention as attention_module
from infer.layers import attention_kernels, attention_metadata
from infer.layers.attention import attention
from infer.layers.attention_metadata import AttentionMetadata
from tests.grids import pairwise_grid

BLOCK = 16


def _ops():
    if os.environ.get("INFER_NO_KERNELS", "") not in ("", "0"):
        pytest.skip("INFER_NO_KERNELS is set")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    ops = kernels.load()
    assert ops is not None, "the kernel did not build: see the warning logged by infer.kernels"
    return ops


def make_step(num_heads, num_kv_heads, head_dim, query_lens, seq_lens, dtype, seed=0):
    """A step over a cache of scattered blocks holding random earlier keys: q, k, v of its new tokens,
    metadata, and each sequence's block ids."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for b in blocks_per_seq:
        tables.append(ids[start : start + b])
        start += b
    width = max(blocks_per_seq) + 1  # a padded table, as the runner's
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    shape = (num_blocks, BLOCK, num_kv_heads, head_dim)
    cache = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    slots = [
        tables[i][p // BLOCK] * BLOCK + p % BLOCK
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for p in range(s - q, s)
    ]
    num_tokens = sum(query_lens)
    # q as the models make it: a view of a wider projection (strided tokens)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta = AttentionMetadata(list(query_lens), list(seq_lens), torch.tensor(slots), block_tables, [cache])
    return q, k, v, meta, tables


def reference(q, meta: AttentionMetadata, tables, scale, window):
    """Each sequence's queries over its causal context (within the window), slot by slot, in float64."""
    num_kv_heads, head_dim = meta.kv_caches[0][0].shape[2:]
    group = q.shape[1] // num_kv_heads
    key_cache, value_cache = (c.double().view(-1, num_kv_heads, head_dim) for c in meta.kv_caches[0])
    out, row = [], 0
    for table, query_len, seq_len in zip(tables, meta.query_lens, meta.seq_lens, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)])
        keys, values = (c[slots].repeat_interleave(group, dim=1) for c in (key_cache, value_cache))
        scores = torch.einsum("qhd,khd->hqk", q[row : row + query_len].double(), keys) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values))
        row += query_len
    return torch.cat(out)


def run_both(q, k, v, meta_args, scale, window, monkeypatch, fallback="matmul_batched"):
    """The step through the kernels and through the Python path (the matmuls, SDPA), each on fresh
    metadata; `fallback`, the Python function the kernel path must not reach, is removed there."""
    out = {}
    for path in ("kernel", "python"):
        with monkeypatch.context() as m:
            if path == "python":
                m.setattr(kernels, "load", lambda: None)
            else:  # no silent fallback
                m.setattr(attention_module, fallback, None)
            meta = AttentionMetadata(*meta_args)
            out[path] = attention(q, k, v, meta, 0, scale, window)
    return out["kernel"], out["python"]


# bfloat16: the output is rounded to 8 bits (the Python path also rounds scores and probabilities)
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "dtype, group, head_dim, window, batch",
    pairwise_grid(
        [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")],
        [1, 2, 4],
        [64, 128],
        [None, 100],
        [1, 2, 7, 33],
    ),
)
def test_decode_matches_reference_and_python_path(dtype, group, head_dim, window, batch, monkeypatch):
    _ops()
    num_kv_heads = 2
    gen = torch.Generator().manual_seed(batch * 1000 + group * 10 + head_dim)
    seq_lens = torch.randint(1, 2001, (batch,), generator=gen).tolist()
    seq_lens[0] = 2000 if batch > 1 else seq_lens[0]  # the longest, split across the threads
    if batch > 2:
        seq_lens[1] = 1  # a first decode of a one-token prompt
    heads = (group * num_kv_heads, num_kv_heads, head_dim)
    q, k, v, meta, tables = make_step(*heads, [1] * batch, seq_lens, dtype)
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, meta.kv_caches)
    scale = head_dim**-0.5
    got, python = run_both(q, k, v, meta_args, scale, window, monkeypatch)
    assert got.dtype == dtype and got.shape == q.shape
    expected = reference(q, meta, tables, scale, window)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), python.double(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_long_stream_split_across_threads(threads):
    """One sequence: its context is split into parts, one or more per thread, merged at the end."""
    ops = _ops()
    q, _, _, meta, tables = make_step(8, 1, 64, [1], [1999], torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        got = ops.paged_attention(q, *meta.kv_caches[0], meta.block_tables, seq_lens, None, 0.125, 0)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), reference(q, meta, tables, 0.125, None), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
def test_a_rows_output_does_not_depend_on_its_batch_or_later_keys(dtype):
    """A decode's output is the same bit for bit alone, beside other sequences (which change how many
    items the threads share) and as the first query of a verification-like chunk whose later queries add
    keys past it: speculative decoding's verification must give the row a lone decode gives."""
    ops = _ops()
    q, _, _, meta, _ = make_step(8, 2, 64, [4, 1, 1], [1300, 2000, 70], dtype)
    caches, tables = meta.kv_caches[0], meta.block_tables
    decode_row = q[:1].contiguous()  # query 0 of sequence 0, at position 1296: a decode of 1,297 keys

    def call(q_rows, seqs, seq_lens, starts):
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = None if starts is None else torch.tensor(starts, dtype=torch.int32)
        return ops.paged_attention(q_rows, *caches, tables[seqs], lens, starts, 0.125, 0)

    alone = call(decode_row, [0], [1297], None)
    in_batch = call(torch.cat([decode_row, q[4:6]]), [0, 1, 2], [1297, 2000, 70], None)
    as_verification = call(q, [0, 1, 2], [1300, 2000, 70], [0, 4, 5, 6])
    for threads in (1, 2, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(call(decode_row, [0], [1297], None), alone)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(in_batch[:1], alone)
    assert torch.equal(as_verification[:1], alone)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_queries_over_a_16_bit_cache_are_the_cache_dtypes_call(half):
    """Float32 queries over a bf16 or fp16 cache (a float32 model's 16-bit cache): the kernel reads them
    rounded to the cache's dtype and rounds its output to it, bit for bit the call with q converted first
    and its output widened after, decodes and a chunk, split contexts included."""
    ops = _ops()
    q, _, _, meta, _ = make_step(8, 2, 64, [1, 5, 1], [1300, 200, 70], half, seed=3)
    wide = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)) * 3  # finer than the cache
    lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    args = (*meta.kv_caches[0], meta.block_tables, lens, starts, 0.125, 0)
    got = ops.paged_attention(wide, *args)
    assert got.dtype == torch.float32
    assert torch.equal(got, ops.paged_attention(wide.to(half), *args).float())


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
def test_chunks_with_decodes(dtype, window, monkeypatch):
    """Queries longer than one (chunks of a prompt) beside decodes: each query sees its causal context."""
    _ops()
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 1 << 30)  # chunks ride in the batch
    monkeypatch.setattr(attention_kernels, "KERNEL_MAX_QUERY_LEN", 1 << 30)  # and in the kernel
    monkeypatch.setattr(attention_metadata, "PREFILL_KERNEL_MIN_QUERY_LEN", 1 << 30)  # not the prefill one
    query_lens, seq_lens = [1, 7, 1, 16, 3], [300, 700, 9, 16, 60]  # seq 3 is a fresh prompt
    q, k, v, meta, tables = make_step(8, 2, 64, query_lens, seq_lens, dtype)
    assert not meta.loop_seqs and meta.max_query_len == 16
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, meta.kv_caches)
    got, python = run_both(q, k, v, meta_args, 0.125, window, monkeypatch)
    expected = reference(q, meta, tables, 0.125, window)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), python.double(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
def test_chunk_rows_that_see_no_key_of_an_odd_tile(dtype, monkeypatch):
    """A chunk's early queries see none of a last tile of odd length (65 keys: the tile [64, 65) holds
    query 2's key only): their probabilities there are 0, also in the padding that bf16's pairs of keys
    read; a context split into parts beside them."""
    _ops()
    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 1 << 30)
    monkeypatch.setattr(attention_kernels, "KERNEL_MAX_QUERY_LEN", 1 << 30)
    monkeypatch.setattr(attention_metadata, "PREFILL_KERNEL_MIN_QUERY_LEN", 1 << 30)
    q, k, v, meta, tables = make_step(8, 2, 64, [3, 7, 1], [65, 133, 1999], dtype)
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, meta.kv_caches)
    got, _ = run_both(q, k, v, meta_args, 0.125, None, monkeypatch)
    assert torch.isfinite(got).all()
    expected, tol = reference(q, meta, tables, 0.125, None), TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


def test_sequences_without_queries_are_skipped():
    """A decode graph's arguments hold a sequence per row: the rows past the step's sequences have no
    queries and seq_len 0. The real sequences' output is the same bit for bit as without them."""
    ops = _ops()
    q, _, _, meta, _ = make_step(8, 2, 64, [3, 1, 2], [40, 700, 2], torch.bfloat16)
    caches, tables = meta.kv_caches[0], meta.block_tables
    starts = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    expected = ops.paged_attention(q, *caches, tables, seq_lens, starts, 0.125, 0)
    padded_tables = torch.cat([tables, torch.zeros(3, tables.shape[1], dtype=tables.dtype)])
    padded_lens = torch.cat([seq_lens, torch.zeros(3, dtype=torch.int32)])
    padded_starts = torch.cat([starts, torch.full((3,), 6, dtype=torch.int32)])
    got = ops.paged_attention(q, *caches, padded_tables, padded_lens, padded_starts, 0.125, 0)
    assert torch.equal(got, expected)
    padded_lens[-1] = 1
    with pytest.raises(RuntimeError, match="without queries must have seq_len 0"):
        ops.paged_attention(q, *caches, padded_tables, padded_lens, padded_starts, 0.125, 0)


def test_queries_of_a_sequence_of_no_keys_are_zeros_and_write_no_slot():
    """A decode graph's padding rows: queries of a sequence of seq_len 0 (its output rows are zeros, the
    real ones unchanged) whose keys and values go to slot -1, which write_cache skips."""
    ops = _ops()
    q, k, v, meta, _ = make_step(8, 2, 64, [3, 1], [40, 700], torch.bfloat16)
    caches, tables = meta.kv_caches[0], meta.block_tables
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    expected = ops.paged_attention(
        q, *caches, tables, seq_lens, torch.tensor([0, 3, 4], dtype=torch.int32), 0.125, 0
    )
    padded_q = torch.cat([q, torch.randn(3, *q.shape[1:], dtype=q.dtype)])
    padded_tables = torch.cat([tables, tables[:1]])
    padded_lens = torch.cat([seq_lens, torch.zeros(1, dtype=torch.int32)])
    starts = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    got = ops.paged_attention(padded_q, *caches, padded_tables, padded_lens, starts, 0.125, 0)
    assert torch.equal(got[:4], expected) and not got[4:].any()
    before = [c.clone() for c in caches]
    kv = torch.randn(3, *k.shape[1:], dtype=k.dtype)
    ops.write_cache(kv, kv.clone(), *caches, torch.tensor([-1, 5, -1]))
    changed = (caches[0] != before[0]).reshape(-1, *k.shape[1:]).any(dim=(1, 2))
    assert changed.nonzero().flatten().tolist() == [5] and torch.equal(
        caches[0].view(-1, *k.shape[1:])[5], kv[1]
    )


def test_bad_arguments_raise():
    ops = _ops()
    q, _, _, meta, _ = make_step(4, 2, 64, [1, 1], [20, 5], torch.float32)
    key_cache, value_cache = meta.kv_caches[0]
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(q, key_cache, value_cache, meta.block_tables + 1000, seq_lens, None, 1.0, 0)
    with pytest.raises(RuntimeError, match="too short"):
        ops.paged_attention(q, key_cache, value_cache, meta.block_tables, seq_lens * 100, None, 1.0, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_attention(q.double(), key_cache, value_cache, meta.block_tables, seq_lens, None, 1.0, 0)


def check_shapes(ops) -> None:
    """Every dtype over a few head shapes (GQA groups 1 to 8, head_dim 16 to 256, windows) in one step of
    a long, a one-token and a short context. bf16's probs @ values on vdpbf16ps takes head_dim in groups
    of 64 and 32 dims (96: one of each; 80 and 16 keep the float32 FMAs)."""
    heads = ((1, 64, None), (4, 128, 50), (2, 16, None), (2, 80, 7), (8, 256, None))
    heads += ((3, 96, None), (1, 32, 20))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for group, head_dim, window in heads:
            q, _, _, meta, tables = make_step(2 * group, 2, head_dim, [1, 1, 1], [700, 1, 33], dtype)
            seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
            args = (*meta.kv_caches[0], meta.block_tables, seq_lens, None, 0.1, window or 0)
            got = ops.paged_attention(q, *args)
            expected = reference(q, meta, tables, 0.1, window)
            torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_shapes():
    check_shapes(_ops())


ISA_CHECK = """
from infer import kernels
from tests.models.test_kernels import check_shapes
from tests.models.test_layer_ops import check_layer_ops
ops = kernels.load()
check_shapes(ops)
check_layer_ops(ops)
print(ops.isa())
"""


@pytest.mark.slow  # builds the kernels for each ISA
@pytest.mark.parametrize("march, isa", [("x86-64-v3", "avx2"), ("x86-64", "scalar")])
def test_other_isas(march, isa):
    """The AVX2 and plain C++ paths (decode attention and the layer ops), built for a lesser x86-64
    than this one (in their own build directory; the first run compiles each, ~15 s)."""
    _ops()
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 only")
    env = dict(os.environ, INFER_KERNELS_MARCH=march)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", ISA_CHECK], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == isa


OPS = (
    "paged_attention",
    "prefill_attention",
    "quant_linear",
    "six_bit_linear",
    "small_linear",
    "small_linear_silu",
    "onednn_linear",
    "rms_norm",
    "add_rms_norm",
    "rotary",
    "silu_and_mul",
    "argmax_rows",
    "write_cache",
)


def test_tracers_record_each_op_as_one_call():
    """Every op's kernel is registered for the CPU dispatch key, not as a catch-all, so that a tracer
    (make_fx, torch.compile) records a call as the op itself instead of tracing into its allocations:
    what a captured decode step needs (infer/runner/decode_graph.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = _ops()
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"infer_kernels::{name}", "CPU"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(
            f"infer_kernels::{name}", "CompositeImplicitAutograd"
        ), name
    x, weight = torch.randn(4, 64), torch.randn(64)
    traced = make_fx(lambda x, w: ops.rms_norm(x, w, 1e-6))(x, weight)
    calls = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert calls == ["infer_kernels.rms_norm.default"]
    torch.testing.assert_close(traced(x, weight), ops.rms_norm(x, weight, 1e-6))


def test_disabled_by_env(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("INFER_NO_KERNELS", "1")
    assert kernels.load() is None


def test_failed_build_falls_back_once_and_is_not_retried(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    monkeypatch.delenv("INFER_NO_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "SOURCES", [broken])
    monkeypatch.setattr(kernels, "build_root", lambda: tmp_path / "build")
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="infer.kernels"):
        assert kernels.load() is None
        assert kernels.load() is None  # cached: no second attempt, no second warning
    assert sum("Python path" in r.getMessage() for r in caplog.records) == 1
    assert (kernels.build_dir() / "FAILED").exists()
    monkeypatch.setattr(kernels, "_state", {})  # a later process: no rebuild, one warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer.kernels"):
        assert kernels.load() is None
    assert [r.getMessage() for r in caplog.records if "building" in r.getMessage()] == []
