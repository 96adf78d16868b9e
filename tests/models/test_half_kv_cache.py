"""A 16-bit KV cache under a float32 model (`--kv-cache-dtype float16 / bfloat16`, llama.cpp's default
cache): the write rounds keys and values into it, the decode kernel reads the queries rounded to the
cache's dtype, the Python path converts what it reads; each against a float64 reference over what the
cache holds. The engine over such a cache: tests/engine/test_engine.py."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.layers import attention as attention_module
from infer.layers.attention_metadata import AttentionMetadata
from tests.models.test_kernels import _ops, make_step, reference

HALVES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]


@pytest.mark.parametrize("half", HALVES, ids=IDS)
@pytest.mark.parametrize("path", ["kernel", "python"])
def test_float32_queries_attend_over_what_the_cache_holds(half, path, monkeypatch):
    """A whole attention() step (its write, decodes, a chunk, a fresh prompt) of float32 q, k, v over a
    16-bit cache, through the kernels and through the Python path, against the float64 reference over the
    cache as written: the new keys and values land rounded to the cache's dtype, and the decodes (the
    kernel's, whose queries are rounded too) stay within that rounding of the exact attention."""
    _ops()
    q, k, v, meta, tables = make_step(8, 2, 64, [1, 1, 40, 50], [900, 33, 300, 50], torch.float32)
    caches = [tuple(c.to(half) for c in meta.kv_caches[0])]
    meta_args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, caches)
    if path == "python":
        monkeypatch.setattr(kernels, "load", lambda: None)
    else:  # no silent fallback to the matmuls
        monkeypatch.setattr(attention_module, "matmul_batched", None)
    meta = AttentionMetadata(*meta_args, query_dtype=torch.float32)
    out = attention_module.attention(q, k, v, meta, 0, 0.125)
    assert out.dtype == torch.float32
    new_keys = caches[0][0].view(-1, 2, 64)[meta.slot_mapping]
    assert torch.equal(new_keys, k.to(half))  # written rounded to the cache's dtype
    expected = reference(q, meta, tables, 0.125, None)  # over the cache as written
    # the queries rounded like the cache (the kernel's decodes), the output rounded to it on the way back
    tol = 2e-2 if half == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("half", HALVES, ids=IDS)
def test_decode_kernel_reads_a_16_bit_cache_under_float32_queries(half):
    """The step's decodes go to the C++ kernel (not the matmuls) with a 16-bit cache under float32
    queries, wherever the kernels are built, the queries as they are (the kernel rounds them)."""
    _ops()
    q, _, _, meta, tables = make_step(4, 2, 32, [1, 1], [20, 70], torch.float32)
    caches = [tuple(c.to(half) for c in meta.kv_caches[0])]
    args = (meta.query_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables, caches)
    meta = AttentionMetadata(*args, query_dtype=torch.float32)
    assert meta.batch_seqs == [0, 1]
    calls = []
    real = attention_module._kernel_batched

    def counted(ops, q, *args):
        calls.append(q.dtype)
        return real(ops, q, *args)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention_module, "_kernel_batched", counted)
        m.setattr(attention_module, "matmul_batched", None)
        out = attention_module._batched(q, *caches[0], meta, 0.5, None)
    assert calls == [torch.float32] and out.dtype == torch.float32
    tol = 2e-2 if half == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), reference(q, meta, tables, 0.5, None), atol=tol, rtol=tol)
