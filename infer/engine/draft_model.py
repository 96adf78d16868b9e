"""The draft model of speculative decoding (`{"method": "draft_model", "model": PATH}`): loaded as the
target is (its dtype, load format, quantization), checked against the target (the same token ids, enough
positions), and handed to the runner's DraftProposer with a KV pool of its own."""

from __future__ import annotations

import dataclasses

from infer.engine.tokenizer import load_tokenizer
from infer.models.gguf import is_gguf
from infer.models.loader import load_engine_model
from infer.runner.draft_proposer import DraftProposer


def draft_proposer(engine, num_blocks: int) -> DraftProposer:
    """The draft of engine.config.speculative_config, for an engine whose target, tokenizer, scheduler
    config and KV cache dtype are built; ValueError when the draft does not fit the target."""
    config, spec = engine.config, engine.config.speculative_config
    draft, draft_config, draft_path = load_engine_model(dataclasses.replace(config, model=spec.model))
    own = is_gguf(draft_path) or (draft_path / "tokenizer.json").is_file()
    draft_tokenizer = load_tokenizer(draft_path) if own else None  # none of its own: the target's is its
    if draft_config.max_position_embeddings < engine.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model reads {draft_config.max_position_embeddings} positions, "
            f"fewer than the target's max_model_len {engine.max_model_len}; lower --max-model-len to that"
        )
    target_vocab_size = engine.model_config.vocab_size
    check_draft_vocabulary(target_vocab_size, engine.tokenizer, draft_config.vocab_size, draft_tokenizer)
    # as many tokens as the target's pool, and each running request's last proposals on top
    lookahead = -(-spec.num_speculative_tokens // config.block_size) + 1
    return DraftProposer(
        draft,
        spec.num_speculative_tokens,
        num_blocks + engine.scheduler_config.max_num_seqs * lookahead,
        config.block_size,
        engine.scheduler_config.max_num_batched_tokens,
        engine.kv_cache_dtype,
        None if config.enforce_eager else engine.max_model_len + spec.num_speculative_tokens,
    )


def check_draft_vocabulary(target_vocab_size: int, target_tokenizer, draft_vocab_size: int, draft_tokenizer):
    """ValueError unless the draft's token ids mean what the target's do: the same number of logits,
    and, when the draft has a tokenizer of its own, the same token at every id."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary has {draft_vocab_size} tokens, the target's "
            f"{target_vocab_size}: a draft must share the target's tokenizer"
        )
    if draft_tokenizer is None:
        return
    size = target_tokenizer.vocab_size
    if draft_tokenizer.vocab_size != size:
        raise ValueError(
            f"speculative_config: the draft's tokenizer has {draft_tokenizer.vocab_size} tokens, the "
            f"target's {size}: a draft must share the target's tokenizer"
        )
    for token_id in range(size):
        draft_token = draft_tokenizer.id_to_token(token_id)
        target_token = target_tokenizer.id_to_token(token_id)
        if draft_token != target_token:
            raise ValueError(
                f"speculative_config: token id {token_id} is {draft_token!r} to the draft's tokenizer and "
                f"{target_token!r} to the target's: a draft must share the target's tokenizer"
            )
