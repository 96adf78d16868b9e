"""Build the embedding and reranking models of the embeddings race, in real shapes with random weights:
Hugging Face folders (for `infer serve` and `vllm serve`) and GGUF files (for `llama-server`).

    python scripts/make_embedding_models.py /work/models            # all three
    python scripts/make_embedding_models.py /work/models --only bge-small

- bge-small: BAAI/bge-small-en-v1.5's shape (BertModel: 12 layers, hidden 384, 12 heads, intermediate
  1536, 512 positions, vocabulary 30522), CLS pooling, normalised, as its sentence-transformers files say.
- minilm-reranker: the same BERT as a cross-encoder (BertForSequenceClassification, one label: the shape
  of cross-encoder/ms-marco-MiniLM-L12-v2), for /rerank.
- qwen3-embedding-0.6b: Qwen/Qwen3-Embedding-0.6B's shape (Qwen3: 28 layers, hidden 1024, 16 heads, 8 KV
  heads, head_dim 128, intermediate 3072, vocabulary 151669), last-token pooling, normalised; saved as the
  real one is, the body alone under config.json's `Qwen3ForCausalLM` (`--runner pooling` serves it).

Weights are transformers' own random init (seeded), in bfloat16. The tokenizers are trained on the KJV
Genesis shipped with infer (infer/assets/toy/genesis.txt) and padded with plain tokens to the model's
vocabulary: BERT's a lowercasing WordPiece with [CLS] A [SEP] (B [SEP]); Qwen3's a byte-level BPE with
Qwen2's pre-tokenizer, appending <|endoftext|> (the token Qwen3-Embedding pools), as the real one's does.

The GGUF files (bf16) come from llama.cpp's converter (scripts/fetch_llama_cpp.py). llama.cpp names a
BPE pre-tokenizer by the hash of a test text's ids and knows only published tokenizers: these are
declared as the ones they copy (`bert-bge`, `qwen2`), so llama.cpp splits text as the folders' do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "infer" / "assets" / "toy" / "genesis.txt"

BERT = dict(
    vocab_size=30522, hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
    max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0,
)  # fmt: skip
QWEN3 = dict(
    vocab_size=151669, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's (and Qwen3's) pre-tokenizer: the split llama.cpp applies for tokenizer.ggml.pre = "qwen2"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def pad_vocab(vocab: dict[str, int], size: int, name) -> None:
    """Plain tokens up to `size` ids: never produced by encoding, decoded as visible text."""
    if len(vocab) > size:
        raise ValueError(f"the trained vocabulary ({len(vocab)}) is larger than the model's {size}")
    for i in range(len(vocab), size):
        vocab[name(i)] = i


def wordpiece_tokenizer(out: Path, vocab_size: int) -> None:
    """A BERT tokenizer (lowercasing WordPiece) trained on the corpus, padded with [unusedN]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS)
    tok.train_from_iterator(corpus_lines(), trainer)
    vocab = tok.get_vocab()
    trained = len(vocab)
    pad_vocab(vocab, vocab_size, lambda i: f"[unused{i}]")
    model = models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100)
    padded = Tokenizer(model)
    padded.normalizer, padded.pre_tokenizer = tok.normalizer, tok.pre_tokenizer
    padded.add_special_tokens(BERT_SPECIALS)
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    padded.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    padded.decoder = decoders.WordPiece()
    out.mkdir(parents=True, exist_ok=True)
    padded.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    print(f"{out.name}: WordPiece, {trained} trained tokens, padded to {vocab_size}")


def bpe_tokenizer(out: Path, vocab_size: int) -> None:
    """A Qwen3-like tokenizer: byte-level BPE after Qwen2's split, trained on the corpus, <|endoftext|>
    appended to every text, padded with <unusedN>."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    trainer = trainers.BpeTrainer(
        vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    trained = len(vocab)
    pad_vocab(vocab, vocab_size - len(QWEN_SPECIALS), lambda i: f"<unused{i}>")
    data["added_tokens"] = [
        {"id": len(vocab) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(QWEN_SPECIALS)
    ]  # fmt: skip
    eos = len(vocab)
    data["post_processor"] = json.loads(
        processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", eos)],
        ).__getstate__()
    )  # fmt: skip
    data["decoder"] = json.loads(decoders.ByteLevel().__getstate__())
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 32768,
        "padding_side": "left",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(f"{out.name}: byte-level BPE, {trained} trained tokens, padded to {vocab_size}")


def sentence_transformers(out: Path, pooling: str, dim: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": dim, "pooling_mode": pooling, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=1))


def save(model, out: Path, architecture: str) -> None:
    import torch

    model.config.architectures = [architecture]
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{out.name}: {architecture}, {num_params:,} parameters (bf16)")


def build_bert(out: Path, seed: int, reranker: bool) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    wordpiece_tokenizer(out, BERT["vocab_size"])
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    if reranker:
        config = BertConfig(**BERT, num_labels=1, id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0})
        model = BertForSequenceClassification(config)
    else:
        model = BertModel(BertConfig(**BERT))
    torch.set_default_dtype(torch.float32)
    save(model, out, "BertForSequenceClassification" if reranker else "BertModel")
    if not reranker:
        sentence_transformers(out, "cls", BERT["hidden_size"])


def build_qwen3(out: Path, seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    bpe_tokenizer(out, QWEN3["vocab_size"])
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3Model(Qwen3Config(**QWEN3, eos_token_id=QWEN3["vocab_size"] - len(QWEN_SPECIALS)))
    torch.set_default_dtype(torch.float32)
    # as Qwen3-Embedding-0.6B: the body's tensors (no `model.` prefix) under a causal LM's architecture
    save(model, out, "Qwen3ForCausalLM")
    sentence_transformers(out, "lasttoken", QWEN3["hidden_size"])


def check_tokenizer(out: Path, first: str, last: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    text = "In the beginning God created the heaven and the earth."
    ids = tok(text).input_ids
    assert tok.convert_ids_to_tokens(ids[0]) == first or first == "", ids
    assert tok.convert_ids_to_tokens(ids[-1]) == last, ids
    assert tok.decode(ids, skip_special_tokens=True).lower() == text.lower(), tok.decode(ids)


def convert_to_gguf(jobs: list[dict]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.models.gguf_files import convert  # the tests' driver of llama.cpp's converter

    convert([{**job, "outtype": "bf16"} for job in jobs])


# name: (build(out, seed), the first and last tokens of an encoded text, llama.cpp's pre-tokenizer)
MODELS = {
    "bge-small": (lambda out, seed: build_bert(out, seed, False), ("[CLS]", "[SEP]"), "bert-bge"),
    "minilm-reranker": (lambda out, seed: build_bert(out, seed, True), ("[CLS]", "[SEP]"), "bert-bge"),
    "qwen3-embedding-0.6b": (build_qwen3, ("", "<|endoftext|>"), "qwen2"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the folder the models go in (each in a folder of its name)")
    p.add_argument("--only", default=None, help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--no-gguf", action="store_true", help="Hugging Face folders only")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    unknown = set(names) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    jobs = []
    for name in names:
        build, (first, last), pre = MODELS[name]
        folder = args.out / name
        if not (folder / "model.safetensors").is_file():
            build(folder, args.seed)
            check_tokenizer(folder, first, last)
        gguf = args.out / f"{name}-bf16.gguf"
        if not args.no_gguf and not gguf.is_file():
            jobs.append({"model": str(folder), "out": str(gguf), "pre": pre})
    if jobs:
        convert_to_gguf(jobs)
    for name in names:
        print(args.out / name, *([args.out / f"{name}-bf16.gguf"] if not args.no_gguf else []))


if __name__ == "__main__":
    main()
