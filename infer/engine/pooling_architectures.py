"""Which architectures are pooling models, and which task a model serves under --runner: read from
config.json alone, without torch."""

from __future__ import annotations

from infer.models.pooler_config import CLASSIFY, EMBED

# decoders with a score head (infer.models.decoder_classifier): Qwen3-Reranker, as converted or with
# vLLM's --hf-overrides
DECODER_CLASSIFIERS = (
    "Qwen3ForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "LlamaForSequenceClassification",
)

# architectures that are pooling models whatever --runner says (encoders, cross-encoders, decoder bodies)
POOLING_ARCHITECTURES = {
    "BertModel": EMBED,
    "XLMRobertaModel": EMBED,
    "Qwen3Model": EMBED,
    "LlamaModel": EMBED,
    "BertForSequenceClassification": CLASSIFY,
    "XLMRobertaForSequenceClassification": CLASSIFY,
    **dict.fromkeys(DECODER_CLASSIFIERS, CLASSIFY),
}
DECODER_ARCHITECTURES = (
    "Qwen3Model",
    "LlamaModel",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *DECODER_CLASSIFIERS,
)


def pooling_task(architecture: str, runner: str) -> str | None:
    """EMBED, CLASSIFY, or None for a generation model. ValueError where `runner` cannot serve it."""
    task = POOLING_ARCHITECTURES.get(architecture)
    if runner == "generate" and task is not None:
        raise ValueError(
            f"{architecture} has no LM head: it cannot generate text; serve it with --runner pooling"
        )
    if runner == "pooling" and task is None:
        if architecture not in DECODER_ARCHITECTURES:
            raise ValueError(f"{architecture} cannot serve as a pooling model (--runner pooling)")
        task = EMBED
    return task
