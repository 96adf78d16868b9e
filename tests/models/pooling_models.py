"""Tiny random embedding models and cross-encoders, saved as sentence-transformers folders.

Each folder holds what the hub's do: transformers' config.json and model.safetensors, a tokenizer
(the embedded model's byte-level BPE, its post-processor rewritten to the architecture's special tokens:
BERT's [CLS] A [SEP] B [SEP] with token types, XLM-R's <s> A </s></s> B </s>, Qwen3-Embedding's text +
EOS), and sentence-transformers' modules.json with its Pooling (and Normalize) modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, processors

from infer.models.loader import EMBEDDED_MODEL

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|system|>"  # ids 0, 1, 4 in the embedded tokenizer
VOCAB = 8192
# vLLM's embedding tests' template: "role: content" lines
CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}{% endfor %}"
)
ENCODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def _tokenizer(folder: Path, kind: str, chat_template: bool = False) -> None:
    """chat_template: a template for chats as embedding input (not for a cross-encoder: sentence-transformers'
    CrossEncoder would format its pairs through it)."""
    tok = Tokenizer.from_file(str(EMBEDDED_MODEL / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    specials = [(t, i) for t, i in ids.items()]
    if kind == "bert":
        single, pair = f"{BOS} $A:0 {EOS}", f"{BOS}:0 $A:0 {EOS}:0 $B:1 {EOS}:1"
    elif kind == "roberta":
        single, pair = f"{BOS} $A {EOS}", f"{BOS} $A {EOS} {EOS} $B {EOS}"
    else:  # a decoder embedder: the text, then EOS (the token Qwen3-Embedding pools)
        single, pair = f"$A {EOS}", f"$A {EOS} $B:1 {EOS}:1"
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "cls_token": BOS,
        "sep_token": EOS,
        "model_max_length": 128,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]
        if kind == "bert"
        else ["input_ids", "attention_mask"],
    }
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _perturb(model, seed: int) -> None:
    """Random values in every tensor (norms and biases too), so that a weight loaded wrong shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = "norm" in name.lower() and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm else noise * (0.1 if p.ndim > 1 else 0.05))


def _sentence_transformers(
    folder: Path, pooling: str | None, normalize: bool, dense: list[dict] | None = None, seed: int = 0
) -> None:
    """dense: sentence-transformers Dense modules after the pooler, each its constructor's arguments
    (in_features, out_features, bias, activation_function, use_residual), saved by sentence-transformers."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
        (folder / "1_Pooling").mkdir(exist_ok=True)
        flags = {
            f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "lasttoken", "max_tokens")
        }
        config = {"word_embedding_dimension": 64, **flags}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    for args in dense or []:
        from sentence_transformers.sentence_transformer.modules import Dense

        torch.manual_seed(seed + len(modules))
        layer = Dense(**args)
        _perturb(layer, seed + len(modules))
        name = f"{len(modules)}_Dense"
        (folder / name).mkdir(exist_ok=True)
        layer.save(str(folder / name))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": name,
                        "type": "sentence_transformers.models.Dense"})  # fmt: skip
    if normalize:
        name = f"{len(modules)}_Normalize"
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": name,
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
        (folder / name).mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 128, "do_lower_case": False})
    )


# pooling names as the legacy flags spell them: cls_token, mean_tokens, lasttoken
def build_embedder(
    folder: Path,
    arch: str,
    pooling: str | None = "cls_token",
    normalize: bool = True,
    seed: int = 0,
    extra_config: dict | None = None,
    dense: list[dict] | None = None,
) -> Path:
    """arch: "bert", "xlm-roberta" or "qwen3"; a sentence-transformers embedding model in `folder`
    (with `dense`, Dense modules after its pooler: _sentence_transformers)."""
    import transformers

    kind = {"bert": "bert", "xlm-roberta": "roberta", "qwen3": "decoder"}[arch]
    _tokenizer(folder, kind, chat_template=True)
    torch.manual_seed(seed)
    if arch == "bert":
        config = transformers.BertConfig(**ENCODER, max_position_embeddings=128, pad_token_id=4)
        model = transformers.BertModel(config, add_pooling_layer=False)
    elif arch == "xlm-roberta":
        config = transformers.XLMRobertaConfig(
            **ENCODER,
            max_position_embeddings=128 + 5,
            pad_token_id=4,
            type_vocab_size=1,
            bos_token_id=0,
            eos_token_id=1,
        )
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    else:
        config = transformers.Qwen3Config(
            **ENCODER,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=4,
        )
        model = transformers.Qwen3Model(config)
    for key, value in (extra_config or {}).items():
        setattr(model.config, key, value)
    _perturb(model, seed)
    model.save_pretrained(folder)
    _sentence_transformers(folder, pooling, normalize, dense, seed)
    return folder


def build_cross_encoder(folder: Path, arch: str, num_labels: int = 1, seed: int = 0) -> Path:
    """arch: "bert" or "xlm-roberta"; a sequence-classification model as CrossEncoder loads it."""
    import transformers

    _tokenizer(folder, "bert" if arch == "bert" else "roberta")
    torch.manual_seed(seed)
    if arch == "bert":
        config = transformers.BertConfig(
            **ENCODER, max_position_embeddings=128, pad_token_id=4, num_labels=num_labels
        )
        model = transformers.BertForSequenceClassification(config)
    else:
        config = transformers.XLMRobertaConfig(
            **ENCODER,
            max_position_embeddings=128 + 5,
            pad_token_id=4,
            type_vocab_size=1,
            num_labels=num_labels,
        )
        model = transformers.XLMRobertaForSequenceClassification(config)
    _perturb(model, seed)
    model.save_pretrained(folder)
    return folder


# Qwen3's pre-tokenizer split (its tokenizer.json's), and Qwen3-Reranker's tokenizer_config.json fields
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_THINK = ["<think>", "</think>"]  # added tokens, not special (Qwen3's)
QWEN3_RERANKER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "padding_side": "left",
    "model_max_length": 131072,
    "add_prefix_space": False,
    "errors": "replace",
    "split_special_tokens": False,
    "clean_up_tokenization_spaces": False,
}


def qwen3_reranker_tokenizer(folder: Path) -> int:
    """A tokenizer in Qwen3-Reranker's shape (byte-level BPE after Qwen2's split, no special tokens added
    around a text or a pair, "yes" and "no" single tokens, <|im_start|> / <|im_end|> / <think>); the
    embedded model's merges. Returns its size (with the added tokens)."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

    data = json.loads((EMBEDDED_MODEL / "tokenizer.json").read_text())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    for word, merge in (("no", ["n", "o"]), ("yes", ["y", "es"])):  # "es" is a token already
        vocab[word] = len(vocab)
        merges.append(merge)
    data["added_tokens"] = []
    data["post_processor"] = None
    tok = Tokenizer.from_str(json.dumps(data))
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_THINK])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(QWEN3_RERANKER_CONFIG))
    return tok.get_vocab_size(with_added_tokens=True)


def build_qwen3_reranker(folder: Path, tie_word_embeddings: bool = True, seed: int = 0) -> Path:
    """Qwen3-Reranker's checkpoint shape: a Qwen3ForCausalLM (the 0.6B ties its LM head to the
    embedding, the 8B does not), scored by its "yes" and "no" logits."""
    import transformers

    vocab_size = qwen3_reranker_tokenizer(folder)
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        **(ENCODER | {"vocab_size": vocab_size}),
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=vocab_size - 3,  # <|im_end|>
        pad_token_id=vocab_size - 5,  # <|endoftext|>
    )
    model = transformers.Qwen3ForCausalLM(config)
    _perturb(model, seed)
    if tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    return folder
