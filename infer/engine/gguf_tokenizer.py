"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built as the `tokenizers` tokenizer of the
Hugging Face folder it was converted from, so that both encode a text to the same ids.

Two kinds of vocabulary (`tokenizer.ggml.model`):

- `gpt2`: byte-level BPE, with its merges. How text is split into words before the merges is not in
  the file: `tokenizer.ggml.pre` names it (llama.cpp's names), and PRE_TOKENIZERS holds the Hugging Face
  pre-tokenizer of each name. An unknown name is refused rather than guessed.
- `llama`: SentencePiece BPE with a score per piece and byte fallback. The merges are rebuilt from the
  scores as transformers' converter does (a merge ranks as the score of the piece it makes);
  `tokenizer.ggml.add_space_prefix` (default true) prepends "▁" as Llama 2's tokenizer does, and Gemma's
  (false) does not.

Token types (llama.cpp's): control and unknown tokens become special added tokens, user-defined ones
plain added tokens. The ids that end generation are llama.cpp's: eos, eot, eom, and the control tokens
it recognises by their text (<|im_end|>, <end_of_turn>, ...).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from infer.engine.tokenizer import Tokenizer, bos_eos_processor
from infer.models.gguf import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFModel, end_ids, token_id

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> (pre-tokenizer, NFC normalizer, ignore_merges) as in the original tokenizer.json
PRE_TOKENIZERS = {
    "gpt-2": lambda: (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False, False),
    "llama-bpe": lambda: (_split_then_bytes(_LLAMA3), False, True),
    "qwen2": lambda: (_split_then_bytes(_QWEN2), True, False),
    "deepseek-r1-qwen": lambda: (_split_then_bytes(_QWEN2), True, False),
}
NAMED_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "sep_token": "seperator_token_id",  # llama.cpp's spelling
    "pad_token": "padding_token_id",
    "mask_token": "mask_token_id",
}


def gguf_tokenizer(model: GGUFModel) -> Tokenizer:
    meta = model.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{model.name} holds no tokenizer (tokenizer.ggml.tokens): pass --tokenizer DIR")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_bpe(model, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(model, tokens)
    else:
        raise ValueError(
            f"{model.name}: tokenizer model {kind!r} is not supported (gpt2 and llama are): "
            "pass the original tokenizer's folder with --tokenizer DIR"
        )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=t in (CONTROL, UNKNOWN), normalized=False)
            for i, t in enumerate(types)
            if t in (CONTROL, UNKNOWN, USER_DEFINED)
        ]
    )
    special = {
        name: tokens[i] for name, key in NAMED_IDS.items() if (i := token_id(meta, key, tokens)) is not None
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos_token" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    if add_bos or add_eos:
        backend.post_processor = bos_eos_processor(backend, special, add_bos, add_eos)
    return Tokenizer(backend, special, _chat_templates(meta), end_ids(meta), name=model.name)


def _byte_level_bpe(model: GGUFModel, tokens: list[str]) -> Backend:
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{model.name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}; pass the original tokenizer's folder with --tokenizer DIR"
        )
    pre_tokenizer, nfc, ignore_merges = PRE_TOKENIZERS[pre]()
    merges = [_split_merge(m) for m in model.metadata.get("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    at = merge.find(" ", 1)  # as llama.cpp: a piece may start with a space, never end with one
    return merge[:at], merge[at + 1 :]


def _sentencepiece_bpe(model: GGUFModel, tokens: list[str]) -> Backend:
    scores = list(model.metadata.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = token_id(model.metadata, "unknown_token_id", tokens)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, scores, vocab),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(model.metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if prefix else decode)
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """transformers' SentencePieceExtractor: every split of a piece into two pieces is a merge, ranked by
    the merged piece's score (higher first), ties by the ids of the two halves."""
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        pairs = [
            (piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(score, left, right) for left, right in pairs]
    merges.sort(key=lambda merge: merge[0], reverse=True)
    return [(left, right) for _, left, right in merges]


def _chat_templates(meta: dict[str, Any]) -> str | dict[str, str] | None:
    """tokenizer.chat_template, and the named ones (tokenizer.chat_template.<name>) beside it."""
    default = meta.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {key.removeprefix(prefix): value for key, value in meta.items() if key.startswith(prefix)}
    if not named:
        return default
    return {**named, **({"default": default} if default is not None else {})}
