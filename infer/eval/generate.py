"""A direct generation loop over a block-table KV cache, without the engine's scheduler.

Prompts are prefilled together in one packed forward, then decoded together one token per step.
Each sequence owns a fixed run of blocks. The model tests compare its output with transformers'.
"""

from __future__ import annotations

import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.runner.kv_cache import allocate_kv_cache

BLOCK_SIZE = 16


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    seed: int = 0,
) -> list[list[int]]:
    """Returns the generated ids of each prompt (stopping after an eos id, which is kept)."""
    cfg = model.config
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.max_position_embeddings:
        limit = cfg.max_position_embeddings
        raise ValueError(f"prompt + max_new_tokens = {longest} exceeds the context ({limit})")
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    dtype = next(model.parameters()).dtype
    kv_caches = allocate_kv_cache(cfg, blocks_per_seq * len(prompts), BLOCK_SIZE, dtype)
    block_tables = torch.arange(blocks_per_seq * len(prompts)).view(len(prompts), blocks_per_seq)
    gen = torch.Generator().manual_seed(seed)

    def step(seq_ids: list[int], new_tokens: list[list[int]], starts: list[int]) -> list[int]:
        pos = [torch.arange(s, s + len(t)) for s, t in zip(starts, new_tokens, strict=True)]
        positions = torch.cat(pos)  # [num_tokens]
        slots = torch.cat([_slots(block_tables[i], p) for i, p in zip(seq_ids, pos, strict=True)])
        meta = AttentionMetadata(
            query_lens=[len(t) for t in new_tokens],
            seq_lens=[s + len(t) for s, t in zip(starts, new_tokens, strict=True)],
            slot_mapping=slots,
            block_tables=block_tables[seq_ids],
            kv_caches=kv_caches,
            query_dtype=dtype,
        )
        input_ids = torch.tensor([tok for t in new_tokens for tok in t])
        hidden = model(input_ids, positions, meta)
        last = torch.tensor([len(t) for t in new_tokens]).cumsum(0) - 1
        logits = model.compute_logits(hidden[last])  # [num_seqs, vocab_size]
        if temperature <= 0:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()

    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    new_tokens = [list(p) for p in prompts]
    starts = [0] * len(prompts)
    for _ in range(max_new_tokens):
        sampled = step(active, [new_tokens[i] for i in active], [starts[i] for i in active])
        still = []
        for i, tok in zip(active, sampled, strict=True):
            outputs[i].append(tok)
            starts[i] += len(new_tokens[i])
            new_tokens[i] = [tok]
            if tok not in eos_token_ids:
                still.append(i)
        active = still
        if not active:
            break
    return outputs


def _slots(block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
