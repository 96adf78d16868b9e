"""Our model definitions against transformers: logits in fp32 and greedy generations."""

from __future__ import annotations

import pytest
import torch

from infer.eval.generate import generate
from infer.layers.attention_metadata import AttentionMetadata
from infer.models.loader import load_model

from .tiny_models import VARIANTS, save_tiny_model

PROMPT_LENS = [9, 1, 23, 14]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf_model, path = save_tiny_model(request.param, tmp_path_factory.mktemp("models"))
    ours, cfg, _ = load_model(str(path), dtype="float32")
    return hf_model, ours


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def test_packed_logits_match_transformers(pair):
    hf_model, ours = pair
    batch = prompts(ours.config.vocab_size)
    input_ids = torch.tensor([t for p in batch for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in batch])
    logits = ours.compute_logits(ours(input_ids, positions, AttentionMetadata.prefill_only(PROMPT_LENS)))
    start = 0
    for p in batch:
        expected = hf_model(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(logits[start : start + len(p)], expected, atol=1e-4, rtol=1e-4)
        start += len(p)


def test_greedy_generation_matches_transformers(pair):
    hf_model, ours = pair
    batch = prompts(ours.config.vocab_size)
    got = generate(ours, batch, max_new_tokens=20)
    for p, tokens in zip(batch, got, strict=True):
        out = hf_model.generate(
            torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == out[0, len(p) :].tolist()


@torch.no_grad()
def test_chunked_prefill_through_scattered_blocks_matches_full_forward(pair):
    """Feed a prompt in odd-sized chunks through a paged cache whose blocks are not in order."""
    from infer.runner.kv_cache import allocate_kv_cache

    hf_model, ours = pair
    block_size, chunk = 4, 5
    prompt = prompts(ours.config.vocab_size)[2]  # 23 tokens: chunks cross block and window boundaries
    num_blocks = -(-len(prompt) // block_size)
    kv = allocate_kv_cache(ours.config, num_blocks + 3, block_size, torch.float32)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(0))[:num_blocks]
    got = []
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        positions = torch.arange(start, start + len(ids))
        slots = table[positions // block_size] * block_size + positions % block_size
        meta = AttentionMetadata([len(ids)], [start + len(ids)], slots, table.unsqueeze(0), kv)
        got.append(ours.compute_logits(ours(torch.tensor(ids), positions, meta)))
    expected = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_single_stream_greedy_matches_transformers(pair):
    """One stream over consecutive blocks takes the view path of decode attention (no gather)."""
    hf_model, ours = pair
    prompt = prompts(ours.config.vocab_size)[2]
    got = generate(ours, [prompt], max_new_tokens=20)[0]
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert got == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("batched", [True, False], ids=["one-batched-call", "one-call-per-chunk"])
@torch.no_grad()
def test_mixed_steps_of_decodes_and_chunks_match_full_forward(pair, batched, monkeypatch):
    """Every step carries several sequences at different points (single tokens, chunks of 3 and 5, a
    fresh prompt), so the batched attention pads queries of different lengths, over scattered blocks;
    with MAX_PADDED_SCORES = 0 (and no chunk short enough for the decode kernel) the chunks go one
    sequence at a time instead. Either way, each row's logits equal the full forward's."""
    from infer.layers import attention_metadata
    from infer.runner.kv_cache import allocate_kv_cache

    monkeypatch.setattr(attention_metadata, "MAX_PADDED_SCORES", 1 << 30 if batched else 0)
    if not batched:  # else the decode kernel takes the short chunks whatever the padding
        monkeypatch.setattr(attention_metadata, "PREFILL_KERNEL_MIN_QUERY_LEN", 1)
    hf_model, ours = pair
    batch = prompts(ours.config.vocab_size)
    chunks = [3, 1, 5, 1]  # per sequence, tokens fed per step
    block_size = 4
    blocks_per_seq = [-(-len(p) // block_size) for p in batch]
    kv = allocate_kv_cache(ours.config, sum(blocks_per_seq) + 2, block_size, torch.float32)
    perm = torch.randperm(sum(blocks_per_seq) + 2, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(batch))]
    width = max(blocks_per_seq)
    done = [0] * len(batch)
    got: list[list[torch.Tensor]] = [[] for _ in batch]
    while any(d < len(p) for d, p in zip(done, batch, strict=True)):
        live = [i for i, p in enumerate(batch) if done[i] < len(p)]
        ids, positions, query_lens, seq_lens = [], [], [], []
        for i in live:
            n = min(chunks[i], len(batch[i]) - done[i])
            ids += batch[i][done[i] : done[i] + n]
            positions += range(done[i], done[i] + n)
            query_lens.append(n)
            seq_lens.append(done[i] + n)
        table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in live])
        rows = [j for j, i in enumerate(live) for _ in range(query_lens[j])]
        pos = torch.tensor(positions)
        slots = table[rows, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata(query_lens, seq_lens, slots, table, kv)
        assert bool(meta.loop_seqs) != batched or len(live) == 1 or max(query_lens) == 1
        logits = ours.compute_logits(ours(torch.tensor(ids), pos, meta))
        for j, part in zip(live, logits.split(query_lens), strict=True):
            got[j].append(part)
            done[j] += len(part)
    for p, parts in zip(batch, got, strict=True):
        expected = hf_model(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(torch.cat(parts), expected, atol=1e-4, rtol=1e-4)
