"""ModelConfig: one normalised view of a Hugging Face config.json.

Architectures and transformers versions spell the same facts differently (`rope_theta` + `rope_scaling`
in checkpoints, `rope_parameters` in transformers 5; `n_embd` in GPT-2; Gemma3's per-layer-type rope
bases). `ModelConfig.from_hf` absorbs all of that here so model files read plain fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from infer.layers.rope_config import RopeConfig

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama when configured)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 and Gemma3 normalise q and k per head before rope
    # one entry per layer: FULL or SLIDING; sliding layers see only the last `sliding_window` keys
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # rope of sliding layers where it differs (Gemma3)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Gemma3 configs also carry attn_logit_softcapping, a Gemma2 leftover that transformers ignores; so do we
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype, what `--dtype auto` starts from
    # encoders (BERT, XLM-RoBERTa: infer.models.bert) only
    type_vocab_size: int = 0  # rows of the token-type (segment) embedding; 0: none (decoders)
    position_offset: int = 0  # XLM-RoBERTa numbers positions from pad_token_id + 1
    num_labels: int = 0  # a sequence-classification head's outputs; 0: no head
    # a decoder served as a classifier built from its LM head's rows (vLLM's `classifier_from_token`:
    # Qwen3-Reranker's ["no", "yes"]); infer.models.decoder_classifier
    classifier_from_token: tuple[str, ...] = ()
    classifier_method: str | None = None  # CLASSIFIER_METHODS; None: the checkpoint holds `score.weight`
    classifier_token_ids: tuple[int, ...] = ()  # those tokens' ids, found by the loader in the tokenizer

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding-attention layers need a sliding_window")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict. Raises ValueError for unsupported architectures."""
        if "text_config" in cfg and "hidden_size" not in cfg:
            raise ValueError(
                "multimodal checkpoints are not supported; use a text-only model (e.g. gemma-3-1b-it)"
            )
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
        arch = archs[0]
        if arch == "GPT2LMHeadModel":
            return _from_gpt2(cfg)
        if arch in ENCODERS:
            return _from_encoder(arch, cfg)
        if arch in DECODER_BODIES:  # a decoder saved without its LM head (Qwen3-Embedding): same config
            arch = DECODER_BODIES[arch]
        if arch in DECODER_CLASSIFIERS:  # the causal LM's body with a score head
            body = _from_llama_like(DECODER_CLASSIFIERS[arch], cfg)
            return replace(body, architecture=arch, **_classifier_fields(cfg))
        return _from_llama_like(arch, cfg)


# BERT-family encoders, by the architecture names of their checkpoints (infer.models.bert)
ENCODERS = (
    "BertModel",
    "XLMRobertaModel",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
# a decoder's body saved alone (sentence-transformers saves AutoModel's) -> the causal LM it is the body of
DECODER_BODIES = {"Qwen3Model": "Qwen3ForCausalLM", "LlamaModel": "LlamaForCausalLM"}


# a decoder with a sequence-classification head (its last token's state -> num_labels logits), as vLLM's
# as_seq_cls_model serves it -> the causal LM whose body it has
DECODER_CLASSIFIERS = {
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
}
# vLLM's ways of building the score head from the LM head's rows of `classifier_from_token`:
#   from_2_way_softmax   two tokens [false, true]: one row, true - false (sigmoid of it = the softmax of
#                        the two logits' "true" share: Qwen3-Reranker, mxbai-rerank-v2)
#   no_post_processing   one label per token, its row as it is
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


def _classifier_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    tokens = tuple(cfg.get("classifier_from_token") or ())
    method = cfg.get("method")
    if cfg.get("is_original_qwen3_reranker"):  # vLLM's spelling for Qwen3-Reranker's causal LM checkpoint
        method = "from_2_way_softmax"
    if method is None:
        if tokens:
            raise ValueError(
                'classifier_from_token needs a method: add "is_original_qwen3_reranker": true '
                f'(Qwen3-Reranker) or "method": one of {", ".join(CLASSIFIER_METHODS)}'
            )
        num_labels = len(cfg["id2label"]) if cfg.get("id2label") else cfg.get("num_labels", 2)
        return {"num_labels": num_labels}
    if method not in CLASSIFIER_METHODS:
        raise ValueError(f"method {method!r} is not supported; supported: {', '.join(CLASSIFIER_METHODS)}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"{method} needs classifier_from_token with two tokens (the false one, then the true one: "
            f'["no", "yes"] for Qwen3-Reranker), got {list(tokens)}'
        )
    if not tokens:
        raise ValueError(f"{method} needs classifier_from_token: the tokens whose LM head rows score")
    return {
        "num_labels": 1 if method == "from_2_way_softmax" else len(tokens),
        "classifier_from_token": tokens,
        "classifier_method": method,
    }


def _from_encoder(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{arch} with position_embedding_type {kind!r} is not supported (only absolute)")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(f"{arch} configured as a decoder is not supported; it serves as an encoder")
    num_heads, num_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    roberta = arch.startswith("XLMRoberta")
    num_labels = len(cfg["id2label"]) if cfg.get("id2label") else cfg.get("num_labels", 2)
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=cfg["hidden_size"] // num_heads,
        intermediate_size=cfg["intermediate_size"],
        # XLM-RoBERTa's table holds pad_token_id + 1 rows before the first position
        max_position_embeddings=cfg["max_position_embeddings"]
        - (cfg.get("pad_token_id", 1) + 1 if roberta else 0),
        norm_eps=cfg.get("layer_norm_eps", 1e-12),
        hidden_act=cfg.get("hidden_act", "gelu"),
        layer_types=(FULL,) * num_layers,
        type_vocab_size=cfg.get("type_vocab_size", 2),
        position_offset=cfg.get("pad_token_id", 1) + 1 if roberta else 0,
        num_labels=num_labels if arch.endswith("ForSequenceClassification") else 0,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        dtype=_dtype(cfg),
    )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _dtype(cfg) -> str:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def _rope_params(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(rope of full layers, rope of sliding layers or None) from either spelling."""
    theta = float(cfg.get("rope_theta", 10000.0))
    params = cfg.get("rope_parameters")
    if params and FULL in params:  # transformers 5, per layer type (Gemma3)
        local = params.get(SLIDING)
        return (
            RopeConfig.from_hf(params[FULL], theta),
            RopeConfig.from_hf(local, theta) if local else None,
        )
    rope = RopeConfig.from_hf(params or cfg.get("rope_scaling"), theta)
    local_base = cfg.get("rope_local_base_freq")  # checkpoint spelling of Gemma3's local base
    return rope, (RopeConfig(theta=float(local_base)) if local_base is not None else None)


def _layer_types(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
    elif arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    elif arch == "MistralForCausalLM" and window:
        types = (SLIDING,) * num_layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and window:
        max_window_layers = cfg.get("max_window_layers", num_layers)
        types = tuple(SLIDING if i >= max_window_layers else FULL for i in range(num_layers))
    else:
        types = (FULL,) * num_layers
    return types, (window if SLIDING in types else None)


def _from_llama_like(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    from infer.models.registry import check_supported

    check_supported(arch)
    num_heads = cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    layer_types, window = _layer_types(arch, cfg, num_layers)
    rope, rope_local = _rope_params(cfg)
    gemma = arch == "Gemma3ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    scalar = cfg.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=attention_bias or arch == "Qwen2ForCausalLM",
        o_proj_bias=attention_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        layer_types=layer_types,
        sliding_window=window,
        rope=rope,
        rope_local=rope_local if gemma else None,
        attn_scale=float(scalar) ** -0.5 if gemma and scalar else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        dtype=_dtype(cfg),
    )


def _from_gpt2(cfg: dict[str, Any]) -> ModelConfig:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if cfg.get(flag):
            raise ValueError(f"GPT2LMHeadModel with {flag}=true is not supported")
    hidden = cfg["n_embd"]
    num_layers = cfg["n_layer"]
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=cfg["n_head"],
        num_kv_heads=cfg["n_head"],
        head_dim=hidden // cfg["n_head"],
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        max_position_embeddings=cfg.get("n_positions", 1024),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        hidden_act=cfg.get("activation_function", "gelu_new"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        layer_types=(FULL,) * num_layers,
        attn_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        dtype=_dtype(cfg),
    )
