"""Build a Hugging Face Llama folder with random bf16 weights in a preset's shape, and a real tokenizer.

For races against other servers (vLLM loads a folder, not our presets): both servers then load the same
weights and tokenizer, so prompts, token counts and the work per token are the same on both sides.

    python scripts/make_dummy_model.py llama-50m /work/models/llama-50m
    python scripts/make_dummy_model.py Llama-3.2-1B /work/models/llama-1b
    python scripts/make_dummy_model.py llama-50m /work/models/smollm2-135m-shape --set num_hidden_layers=30 \
        hidden_size=576 num_attention_heads=9 num_key_value_heads=3 intermediate_size=1536 vocab_size=49152 \
        tie_word_embeddings=true max_position_embeddings=8192

- config.json: the preset's (infer/assets/presets), in bfloat16, with the tokenizer's BOS/EOS ids.
- model.safetensors: transformers' LlamaForCausalLM(config) with its own random init (seeded), in bf16.
- tokenizer.json / tokenizer_config.json: the embedded model's recipe (scripts/train_embedded.py: the KJV
  from Debian's bible-kjv, byte-level BPE, BOS prepended on encode, the same chat template), trained up to
  min(--bpe-vocab, vocab_size) tokens and padded with plain `<unusedN>` tokens to exactly `vocab_size`:
  a random model samples every id, and each must decode to visible text (a special or unknown id decodes
  to nothing, which would hide the token from a streaming client's timings).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_embedded import (  # noqa: E402 (the embedded model's corpus and tokenizer recipe)
    BOS_ID,
    END_ID,
    EOS_ID,
    fetch_corpus,
    parse_chapters,
    save_tokenizer,
    train_tokenizer,
)

PRESETS = Path(__file__).resolve().parents[1] / "infer" / "assets" / "presets"


def pad_tokenizer(out: Path, vocab_size: int) -> int:
    """Add plain tokens `<unusedN>` to tokenizer.json's vocabulary up to `vocab_size` ids; return how many.
    They have no merges, so encoding never produces them; decoding shows them as text."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    ids = set(vocab.values()) | {t["id"] for t in data["added_tokens"]}
    if max(ids) + 1 != len(ids):
        raise ValueError(f"{path}: token ids are not contiguous")
    if len(ids) > vocab_size:
        raise ValueError(f"the tokenizer has {len(ids)} tokens, more than the model's {vocab_size}")
    for i in range(len(ids), vocab_size):
        vocab[f"<unused{i}>"] = i
    path.write_text(json.dumps(data, ensure_ascii=False))
    return vocab_size - len(ids)


def build(
    preset: str, out: Path, bpe_vocab: int, seed: int, corpus: Path | None, overrides: dict | None = None
) -> None:
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    config_dict = {**json.loads((PRESETS / preset / "config.json").read_text()), **(overrides or {})}
    vocab_size = config_dict["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)

    if corpus is not None:
        lines = corpus.read_text().splitlines()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            lines, _ = fetch_corpus(Path(tmp))
    tok = train_tokenizer(parse_chapters(lines), min(bpe_vocab, vocab_size))
    trained = tok.get_vocab_size(with_added_tokens=True)
    max_len = min(config_dict["max_position_embeddings"], 131072)
    save_tokenizer(tok, out, max_len=max_len)
    padded = pad_tokenizer(out, vocab_size)
    print(f"tokenizer: {trained} trained tokens + {padded} padding = {vocab_size}")

    config_dict.update(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, END_ID], pad_token_id=EOS_ID)
    config_dict.pop("torch_dtype", None)
    config_dict.pop("transformers_version", None)
    config = LlamaConfig(**config_dict)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory and init time of fp32
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    generation = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, END_ID], pad_token_id=EOS_ID)
    generation.save_pretrained(out)
    for f in out.iterdir():  # model.safetensors comes out 0600; make the folder readable
        f.chmod(0o644)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{preset} {overrides or ''}: {num_params:,} parameters (bf16) in {out}")

    check = AutoTokenizer.from_pretrained(out)
    text = "In the beginning God created the heaven and the earth."
    ids = check(text).input_ids
    assert ids[0] == BOS_ID and check.decode(ids, skip_special_tokens=True) == text, ids
    assert len(check) == vocab_size, (len(check), vocab_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("preset", help="a folder name in infer/assets/presets, e.g. llama-50m, Llama-3.2-1B")
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument("--bpe-vocab", type=int, default=32000, help="most BPE tokens to train (then padding)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--corpus", type=Path, default=None, help="`bible -f` output instead of a download")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE",
        help="config.json fields over the preset's (JSON values): another model's shape in a Llama",
    )  # fmt: skip
    args = p.parse_args()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            p.error(f"--set {item}: the value is not JSON")
    if not (PRESETS / args.preset / "config.json").is_file():
        names = sorted(d.name for d in PRESETS.iterdir() if d.is_dir())
        p.error(f"no preset {args.preset!r}; presets: {', '.join(names)}")
    build(args.preset, args.out, args.bpe_vocab, args.seed, args.corpus, overrides)


if __name__ == "__main__":
    main()
