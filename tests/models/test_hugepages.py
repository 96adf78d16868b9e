"""Packed weights and KV pools on transparent huge pages (infer/kernels/hugepages.py)."""

from __future__ import annotations

import gc

import torch

from infer.kernels import hugepages
from infer.layers.linear import pack_pairs
from infer.models.config import FULL, ModelConfig
from infer.runner.kv_cache import allocate_kv_cache

MIB = 1 << 20


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f]
    return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans)


def huge_bytes(tensor: torch.Tensor) -> int:
    """How many bytes of the mappings under the tensor Linux holds in huge pages (/proc/self/smaps)."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = (lo, hi) if lo < end and hi > start else None
            elif current and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_large_tensors_get_their_own_aligned_mapping_which_dies_with_them():
    t = hugepages.empty((4 * MIB,), torch.bfloat16)  # 8 MiB
    assert t.shape == (4 * MIB,) and t.dtype == torch.bfloat16 and t.is_contiguous()
    if not hugepages.available():  # a kernel without THP (or "never"): torch's allocation
        return
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * 4 * MIB
    assert huge_bytes(t) >= hugepages.HUGE_PAGE  # Linux gave at least one 2 MiB page
    address = t.data_ptr()
    del t
    gc.collect()
    assert not mapped(address)  # unmapped with the tensor's storage


def test_small_tensors_and_the_switch_keep_torch_allocations(monkeypatch):
    small = hugepages.empty((hugepages.MIN_BYTES // 4 - 1,), torch.float32)
    assert small._base is None  # torch.empty: under one huge page, no mapping of its own
    monkeypatch.setenv("INFER_NO_HUGE_PAGES", "1")
    assert not hugepages.available()
    big = hugepages.empty((4 * MIB,), torch.float32)
    assert big.nbytes == 16 * MIB and big._base is None  # torch's own tensor, not a view of a mapping


def test_packed_weights_keep_their_layout():
    weight = torch.randn(2048, 1024).to(torch.bfloat16)  # 4 MiB: on huge pages where available
    packed = pack_pairs(weight)
    reference = weight.reshape(128, 16, 512, 2).transpose(1, 2).contiguous().view(2048, 1024)
    assert torch.equal(packed, reference)
    if hugepages.available():
        assert packed.data_ptr() % hugepages.HUGE_PAGE == 0


def resident_bytes() -> int:
    """The process's resident anonymous memory, by its own accounting (/proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_kv_pools_are_zeroed_and_take_memory_only_as_they_are_written():
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
        layer_types=(FULL, FULL),
    )  # fmt: skip
    before = resident_bytes()
    pools = allocate_kv_cache(cfg, num_blocks=8192, block_size=16, dtype=torch.bfloat16)  # 32 MiB each
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in pools)
    assert pool_bytes == 128 * MIB
    assert resident_bytes() - before < pool_bytes // 8  # allocated, not touched
    assert len(pools) == 2
    for k, v in pools:
        assert k.shape == (8192, 16, 2, 64)
        assert not k[:64].any() and not v[-64:].any()  # reads as zeros
        if hugepages.available():
            assert k.data_ptr() % hugepages.HUGE_PAGE == 0
    written = resident_bytes()
    pools[0][0].fill_(1.0)  # one layer's keys, all blocks
    assert resident_bytes() - written >= pools[0][0].nbytes // 2


def test_a_loaded_models_streamed_weights_are_on_huge_pages():
    from infer import kernels
    from infer.layers.linear import PrepackedLinear
    from infer.models.loader import load_model

    net, _, _ = load_model("llama-50m", dtype="bfloat16", load_format="dummy")
    packed = [m.kernel_weight for m in net.modules() if isinstance(m, PrepackedLinear)]
    large = [w for w in packed if w is not None and w.nbytes >= hugepages.MIN_BYTES]
    if kernels.bf16_ops() is None or not hugepages.available():  # no kernel copies, or no THP
        return
    assert large  # gate_up (3 MiB) of each layer, the LM head's copy (31 MiB)
    assert all(w.data_ptr() % hugepages.HUGE_PAGE == 0 for w in large)
    assert sum(huge_bytes(w) for w in large) >= sum(w.nbytes for w in large) // 2
