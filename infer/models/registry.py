"""The `architectures` string of config.json -> our model class."""

from __future__ import annotations

import importlib

# values are "module:Class" so that importing the registry does not import every model file
MODELS = {
    "LlamaForCausalLM": "infer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "infer.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "infer.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "infer.models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "infer.models.gemma3:Gemma3ForCausalLM",
    "GPT2LMHeadModel": "infer.models.gpt2:GPT2LMHeadModel",
    "BertModel": "infer.models.bert:BertModel",
    "XLMRobertaModel": "infer.models.bert:BertModel",
    "BertForSequenceClassification": "infer.models.bert:BertForSequenceClassification",
    "XLMRobertaForSequenceClassification": "infer.models.bert:XLMRobertaForSequenceClassification",
    "Qwen3ForSequenceClassification": "infer.models.decoder_classifier:DecoderClassifier",
    "Qwen2ForSequenceClassification": "infer.models.decoder_classifier:DecoderClassifier",
    "LlamaForSequenceClassification": "infer.models.decoder_classifier:DecoderClassifier",
}
# decoders served by the pooling runner (`--runner pooling`): the body without its LM head
POOLING_MODELS = {
    "LlamaForCausalLM": "infer.models.decoder_embedding:DecoderEmbeddingModel",
    "Qwen2ForCausalLM": "infer.models.decoder_embedding:DecoderEmbeddingModel",
    "Qwen3ForCausalLM": "infer.models.decoder_embedding:DecoderEmbeddingModel",
}


def check_supported(architecture: str) -> None:
    if architecture not in MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODELS))}"
        )


def model_class(architecture: str, pooling: bool = False):
    """pooling: the class the pooling runner serves (a decoder's body without its LM head)."""
    check_supported(architecture)
    module, name = (POOLING_MODELS if pooling else MODELS).get(architecture, MODELS[architecture]).split(":")
    return getattr(importlib.import_module(module), name)
