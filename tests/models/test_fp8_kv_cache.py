"""The fp8 KV cache (`--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2`): the write's rounding against torch's
conversion, both attention kernels over fp8 codes against the same kernels over the codes' bf16 values and
against a float64 reference, the Python path against the reference, the build without AMX's tiles, and
the engine: twice the blocks in the same memory, and what it costs the embedded model's prefill
(perplexity) and decode steps (the next token's log-likelihood)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from infer import kernels
from infer.config import EngineConfig
from infer.engine.llm import LLM
from infer.eval.perplexity import decode_nll, held_out_text, perplexity
from infer.layers import attention as attention_module
from infer.layers.attention_kernels import kernels_read_fp8
from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.fp8_kv_cache import to_cache_dtype
from infer.runner.kv_cache import warn_unserved_fp8
from infer.sampling_params import SamplingParams
from tests.models.test_kernels import _ops, make_step, reference

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]


def _fp8_ops():
    ops = _ops()
    if "+fp8" not in ops.isa():
        pytest.skip(f"this build ({ops.isa()}) has no fp8 path (AVX-512 BF16 and VBMI)")
    return ops


def fp8_step(fp8, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, seed=0):
    """make_step's bf16 step with its cache in fp8: (q, k, v, meta over the fp8 cache, the same over its
    bf16 values, tables)."""
    heads = (num_heads, num_kv_heads, head_dim)
    q, k, v, meta, tables = make_step(*heads, query_lens, seq_lens, torch.bfloat16, seed)
    codes = tuple((c.float() * 3).to(fp8) for c in meta.kv_caches[0])  # values up to ~12: the formats' range
    args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables)
    fp8_meta = AttentionMetadata(*args, [codes])
    bf16_meta = AttentionMetadata(*args, [tuple(c.to(torch.bfloat16) for c in codes)])
    return q, k, v, fp8_meta, bf16_meta, tables


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
@pytest.mark.parametrize(
    "source", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_write_rounds_and_saturates_as_torch(fp8, source):
    """Every finite bf16 value (and random float16 / float32 ones, beyond the range too) written by the
    kernel is torch's `x.clamp(-max, max).to(fp8)`: nearest, ties to even, subnormals, saturation."""
    ops = _fp8_ops()
    if source == torch.bfloat16:
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        x = x[torch.isfinite(x.float())]
    else:
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(1 << 16, generator=gen) * torch.logspace(-9, 6, 1 << 16)).to(source)
    x = x[: x.numel() // 64 * 64].view(-1, 1, 64)  # [tokens, 1 kv head, 64]
    caches = [torch.zeros(x.shape[0], 1, 1, 64, dtype=fp8) for _ in range(2)]
    ops.write_cache(x, -x, *caches, torch.arange(x.shape[0]))
    limit = torch.finfo(fp8).max
    for cache, src in zip(caches, (x, -x), strict=True):
        expected = src.float().clamp(-limit, limit).to(fp8)
        assert torch.equal(cache.view(torch.uint8).flatten(), expected.view(torch.uint8).flatten())


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
def test_nan_stays_nan_and_infinities_saturate(fp8):
    """NaN is written as a NaN code and read back as NaN (as torch's conversion keeps it); infinities
    become the largest finite value. The kernels' reading of a NaN value is NaN where a bf16 cache's is."""
    ops = _fp8_ops()
    x = torch.zeros(1, 1, 64)
    x[0, 0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    caches = [torch.zeros(1, 1, 1, 64, dtype=fp8) for _ in range(2)]
    ops.write_cache(x, x, *caches, torch.tensor([0]))
    back = caches[0].float().flatten()
    limit = torch.finfo(fp8).max
    assert back[:2].isnan().all() and back[2].item() == limit and back[3].item() == -limit
    q, _, _, meta8, meta16, _ = fp8_step(fp8, 4, 2, 64, [1, 1], [40, 40])
    for meta in (meta8, meta16):
        meta.kv_caches[0][1].view(-1, 2, 64)[5, 0, 3] = float("nan")  # one value of a key of seq 0
    args = (meta8.block_tables, torch.tensor([40, 40], dtype=torch.int32), None, 0.125, 0)
    got = ops.paged_attention(q, *meta8.kv_caches[0], *args)
    same = ops.paged_attention(q, *meta16.kv_caches[0], *args)
    assert got.isnan().any() and torch.equal(got.isnan(), same.isnan())


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
def test_python_write_matches_the_kernel(fp8, monkeypatch):
    """attention()'s write into an fp8 cache: the codes of `to_cache_dtype` (torch's conversion, saturated)
    through write_cache and through the Python path; keys from 1x to 1e5x, past either format's range."""
    _fp8_ops()
    written = {}
    for path in ("kernel", "python"):
        q, k, v, meta, _, _ = fp8_step(fp8, 4, 2, 64, [5, 1], [20, 9])
        k = k * torch.logspace(0, 5, 6).view(-1, 1, 1)
        with monkeypatch.context() as m:
            if path == "python":
                m.setattr(kernels, "load", lambda: None)
            attention_module.attention(q, k, v, meta, 0, 0.125)
        key_cache, value_cache = meta.kv_caches[0]
        rows = [c.view(-1, 2, 64)[meta.slot_mapping].view(torch.uint8) for c in (key_cache, value_cache)]
        expected = [to_cache_dtype(x, fp8).view(torch.uint8) for x in (k, v)]
        assert all(torch.equal(a, b) for a, b in zip(rows, expected, strict=True))
        written[path] = [c.view(torch.uint8).clone() for c in meta.kv_caches[0]]
    for a, b in zip(written["kernel"], written["python"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
@pytest.mark.parametrize("group,head_dim,window", [(1, 64, None), (2, 64, 100), (4, 128, None), (2, 128, 7)])
def test_decode_kernel_reads_the_codes_exactly(fp8, group, head_dim, window):
    """paged_attention over fp8 codes gives what it gives over their bf16 values (every code is a bf16
    value; the decoded order only moves float32 sums), and the float64 reference's output; one long
    context split across the threads, a one-token one, short ones."""
    ops = _fp8_ops()
    seq_lens = [2000, 1, 65, 333, 17]
    q, _, _, meta8, meta16, tables = fp8_step(fp8, 2 * group, 2, head_dim, [1] * 5, seq_lens)
    args = (meta8.block_tables, torch.tensor(seq_lens, dtype=torch.int32), None, head_dim**-0.5, window or 0)
    got = ops.paged_attention(q, *meta8.kv_caches[0], *args)
    same = ops.paged_attention(q, *meta16.kv_caches[0], *args)
    torch.testing.assert_close(got.float(), same.float(), atol=1e-2, rtol=1e-2)
    expected = reference(q, meta16, tables, head_dim**-0.5, window)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
@pytest.mark.parametrize("window", [None, 40])
def test_chunks_and_prompts_over_fp8(fp8, window):
    """Chunks (paged_attention) and prompts and long chunks (prefill_attention) over fp8 codes, against the
    same calls over their bf16 values and the reference; tiles of odd length included."""
    ops = _fp8_ops()
    query_lens, seq_lens = [1, 7, 65, 200, 3], [300, 700, 65, 1000, 60]
    q, _, _, meta8, meta16, tables = fp8_step(fp8, 8, 2, 64, query_lens, seq_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (meta8.block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts, 0.125, window or 0)
    expected = reference(q, meta16, tables, 0.125, window)
    for op in (ops.paged_attention, ops.prefill_attention):
        got = op(q, *meta8.kv_caches[0], *args)
        same = op(q, *meta16.kv_caches[0], *args)
        torch.testing.assert_close(got.float(), same.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", FORMATS, ids=IDS)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_paths_attend_over_what_the_cache_holds(fp8, query_dtype, monkeypatch):
    """A whole attention() step over an fp8 cache (its write, decodes, a chunk, a fresh prompt) through the
    kernels and through the Python path (the write's rounding, gathers converted, SDPA over a fresh
    prompt's keys as the cache holds them), each against the float64 reference over the cache's codes;
    float32 queries (a float32 model) take the Python path either way, the prompts through SDPA."""
    _fp8_ops()
    q, k, v, meta, _, tables = fp8_step(fp8, 8, 2, 64, [1, 1, 40, 50], [900, 33, 300, 50])
    q, k, v = (x.to(query_dtype) * 4 for x in (q, k, v))  # large keys: rounding them moves the scores
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, meta.kv_caches)
    out = {}
    for path in ("kernel", "python"):
        with monkeypatch.context() as m:
            if path == "python":
                m.setattr(kernels, "load", lambda: None)
            elif query_dtype == torch.bfloat16:  # no silent fallback
                m.setattr(attention_module, "matmul_batched", None)
            meta = AttentionMetadata(*meta_args, query_dtype=query_dtype)
            assert meta.loop_seqs == [2, 3]  # the chunk and the fresh prompt: prefill kernel or SDPA
            out[path] = attention_module.attention(q, k, v, meta, 0, 0.125)
    got, python = out["kernel"], out["python"]
    expected = reference(q, meta, tables, 0.125, None)  # over the codes written
    tol = 2e-2 if query_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(python.double(), expected, atol=2 * tol, rtol=2 * tol)


@pytest.mark.slow  # builds the kernels without AMX, runs these tests on them
def test_no_amx_build(tmp_path):
    """The fp8 tests above built without AMX's tiles (prefill on vdpbf16ps alone, as on an AMD EPYC), in a
    subprocess: on a CPU with AMX only, whose build is otherwise the tiles'."""
    _fp8_ops()
    if not kernels.cpu_has_amx() or os.environ.get("INFER_KERNELS_MARCH", "native") != "native":
        pytest.skip("the native build already has no tiles here")
    env = dict(os.environ, INFER_KERNELS_MARCH="sapphirerapids -mno-amx-tile")
    test = "tests/models/test_fp8_kv_cache.py"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    isa = "from infer import kernels; print(kernels.load().isa())"
    # -m "": every one of them, the slow tier's too
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-m", "", "-k", "kernel or chunks or nan"]
    for args in (["-c", isa], tests):
        done = subprocess.run(
            [sys.executable, *args], env=env, cwd=root, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if args[0] == "-c":
            assert "+fp8" in done.stdout and "+amx" not in done.stdout
    assert done.stdout.count(".") >= 15  # the tests that ran, none skipped (s) or failed (F)


def test_unserved_shapes_raise():
    """The kernels read fp8 caches with bf16 queries and a head_dim of a multiple of 64 only (attention.py
    keeps the Python path for the rest)."""
    ops = _fp8_ops()
    for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 32)):
        q, _, _, meta, _ = make_step(4, 2, head_dim, [1], [20], dtype)
        codes = [c.to(torch.float8_e4m3fn) for c in meta.kv_caches[0]]
        seq_lens = torch.tensor([20], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="fp8 cache"):
            ops.paged_attention(q, *codes, meta.block_tables, seq_lens, None, 1.0, 0)


def test_start_up_says_where_the_kernels_do_not_read_fp8(caplog, monkeypatch):
    """The start-up warning follows what the build reads: none for a bf16 model of head_dim 64 on a "+fp8"
    build; one for the shapes it does not take, and for any shape without the kernels."""
    _fp8_ops()

    def warnings(*args):
        caplog.clear()
        with caplog.at_level("WARNING", logger="infer.runner"):
            warn_unserved_fp8(torch.float8_e4m3fn, *args)
        return sum("slower Python path" in r.getMessage() for r in caplog.records)

    assert warnings(torch.bfloat16, 64) == 0
    assert warnings(torch.bfloat16, 32) == warnings(torch.float32, 64) == 1
    monkeypatch.setattr(kernels, "load", lambda: None)  # as with INFER_NO_KERNELS=1, or a failed build
    assert warnings(torch.bfloat16, 64) == 1


@pytest.mark.slow  # the embedded model's perplexity, twice
@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_engine_holds_twice_the_tokens_at_little_perplexity(name, monkeypatch):
    """The embedded model (bf16, head_dim 64: the kernel path where the build reads fp8): the same KV
    memory holds twice the blocks, a generation completes, and on held-out text the perplexity of prompts
    (prefill_attention) and the next token's log-likelihood at decode steps (paged_attention, never the
    Python path where the kernels read fp8) move by under 2% (measured: prompts e4m3 +0.5%, e5m2 +0.4%)."""
    if kernels_read_fp8(torch.bfloat16, 64):
        monkeypatch.setattr(attention_module, "matmul_batched", None)  # decodes must take the kernel
    with LLM(kv_cache_memory_gb=0.05) as auto, LLM(kv_cache_memory_gb=0.05, kv_cache_dtype=name) as fp8:
        assert fp8.engine.kv_cache_dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
        assert fp8.engine.runner.kv_caches[0][0].dtype == fp8.engine.kv_cache_dtype
        assert fp8.engine.cache_config.num_blocks == 2 * auto.engine.cache_config.num_blocks
        assert fp8.engine.runner.kv_cache_bytes <= auto.engine.runner.kv_cache_bytes
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        out = fp8.generate(["In the beginning"], params)
        assert len(out[0].token_ids) == 30
        model = auto.engine.runner.model
        ids = auto.engine.tokenizer.encode(held_out_text())
        base = perplexity(model, ids)
        assert abs(perplexity(model, ids, kv_cache_dtype=fp8.engine.kv_cache_dtype) / base - 1) < 0.02
        base = decode_nll(model, ids[:400], torch.bfloat16)
        assert abs(decode_nll(model, ids[:400], fp8.engine.kv_cache_dtype) / base - 1) < 0.02


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
