"""GGUF files written by llama.cpp's converter load as the Hugging Face folders they came from: the same
config, the same logits, a tokenizer that encodes every text to the same ids, the same chat prompt (quantized
files: test_gguf_quant.py)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from infer.bench import race
from infer.bench.prompts import exact_prompts
from infer.engine.tokenizer import Tokenizer, load_tokenizer
from infer.models.gguf import EOG_TEXTS
from infer.models.loader import EMBEDDED_MODEL, load_model, resolve_model_path

from .gguf_files import ROOT, convert
from .test_loader import forward_logits
from .tiny_models import COMMON

pytestmark = pytest.mark.slow  # one run of llama.cpp's converter for the module: ~30 s

TEXTS = [
    "Hello, world!",
    "  two leading spaces, three trailing   ",
    "tabs\tand\nnew\n\nlines\r\n\r\nand CRLF",
    "       \n\n\n   \t\t  ",
    "Ünïcödé façade naïve — “curly quotes” and ‘single’ ones",
    "e\u0301 composed vs decomposed é, Å vs A\u030a",
    "日本語のテキスト、中文混合 and 한국어",
    "emoji 🦙🚀👍🏽 and a family 👨\u200d👩\u200d👧",
    "digits 1 12 123 1234 12345 123456 3.14159 1,000,000 2026-11-27",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x!r}')",
    "I'm you're he'll we've they'd IT'S You'RE",
    "<|user|>\nhi there<|end|>\n<|assistant|>\n",
    "special <|eos|> inside<|bos|>text<|im_end|>",
    "",
    "x",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + "
    "eos_token }}{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endif %}{% endfor %}"
)
GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
    "{% endif %}"
)
QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def save_llama3_tokenizer(path) -> None:
    """The embedded model's vocabulary under Llama 3's pre-tokenizer: its split regex (digits in threes),
    byte-level without a regex of its own, ignore_merges (a word in the vocabulary is one token)."""
    spec = json.loads((EMBEDDED_MODEL / "tokenizer.json").read_text())
    spec["model"]["ignore_merges"] = True
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    shutil.copy(EMBEDDED_MODEL / "tokenizer_config.json", path)


def save_qwen_tokenizer(path) -> int:
    """The embedded model's vocabulary and merges under Qwen2's tokenizer.json: NFC, its split regex,
    ChatML's tokens, no BOS. Returns the vocabulary size."""
    spec = json.loads((EMBEDDED_MODEL / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    size = len(vocab)
    for i, token in enumerate(QWEN_TOKENS):
        vocab[token] = size + i
        spec["added_tokens"].append(
            {
                "id": size + i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }  # fmt: skip
        )
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False}  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def save_sentencepiece_tokenizer(path, gemma: bool = False) -> int:
    """A SentencePiece BPE model with byte fallback trained here on this project's README, as transformers
    reads it (tokenizer.json) beside its tokenizer.model (which llama.cpp's converter reads): Llama 2's
    kind, or with gemma Gemma's (no "▁" prepended, turn markers as user-defined pieces). Returns the
    vocabulary size."""
    import sentencepiece
    import transformers

    corpus = [line for line in (ROOT / "README.md").read_text().splitlines() if line.strip()]
    # Gemma's special pieces: <pad> 0, <eos> 1, <bos> 2, <unk> 3; Llama 2's: <unk> 0, <s> 1, </s> 2
    ids = (
        dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3)
        if gemma
        else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    )
    names = dict(pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>") if gemma else {}
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(path / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2, add_dummy_prefix=not gemma,
        user_defined_symbols=GEMMA_TURNS if gemma else [], **ids, **names,
    )  # fmt: skip
    (path / "sp.model").rename(path / "tokenizer.model")
    (path / "sp.vocab").unlink()
    kind = transformers.GemmaTokenizer if gemma else transformers.LlamaTokenizer
    tokenizer = kind.from_pretrained(path, add_bos_token=True)  # as Llama 2's and Gemma's
    tokenizer.chat_template = GEMMA_CHAT if gemma else LLAMA2_CHAT
    if gemma:
        tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_TURNS})
    tokenizer.save_pretrained(path)
    if (
        gemma
    ):  # Gemma's tokenizer_config.json (transformers 4's) lists them, where llama.cpp's converter looks
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = {
            str(tokenizer.convert_tokens_to_ids(t)): {"content": t, "special": True} for t in GEMMA_TURNS
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.backend_tokenizer.get_vocab_size()


def save_random_model(path, config_class: str, vocab_size: int, dtype=torch.float32, **overrides):
    import transformers

    config = getattr(transformers, config_class)(
        **{**COMMON, "vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 1, **overrides}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms too: a norm loaded wrong (Gemma's +1) shows up
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """name -> (Hugging Face folder, GGUF file made from it by llama.cpp's converter)."""
    root = tmp_path_factory.mktemp("gguf")
    folders = {"embedded": EMBEDDED_MODEL}
    for name in ("qwen2", "qwen3", "gemma3", "llama3_rope", "spm", "gemma3_spm", "gpt2", "yarn"):
        folders[name] = root / name
        folders[name].mkdir()
    vocab = save_qwen_tokenizer(folders["qwen2"])
    save_random_model(folders["qwen2"], "Qwen2Config", vocab, torch.bfloat16, eos_token_id=vocab - 1)
    save_qwen_tokenizer(folders["qwen3"])
    save_random_model(folders["qwen3"], "Qwen3Config", vocab, head_dim=32, eos_token_id=vocab - 1)
    save_qwen_tokenizer(folders["yarn"])
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0}
    save_random_model(folders["yarn"], "Qwen2Config", vocab, rope_scaling=yarn, eos_token_id=vocab - 1)
    vocab = save_sentencepiece_tokenizer(folders["spm"])
    save_random_model(folders["spm"], "LlamaConfig", vocab, bos_token_id=1, eos_token_id=2)
    vocab = save_sentencepiece_tokenizer(folders["gemma3_spm"], gemma=True)
    save_random_model(folders["gemma3_spm"], "Gemma3TextConfig", vocab, bos_token_id=2, eos_token_id=1,
                      pad_token_id=0, head_dim=32, query_pre_attn_scalar=32, sliding_window=5)  # fmt: skip
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / file, folders["gemma3"])
        shutil.copy(EMBEDDED_MODEL / file, folders["gpt2"])
    # GPT-2 under its own key names (n_embd, ...), with n_ctx, which llama.cpp's converter reads
    gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256, tie_word_embeddings=True)
    save_random_model(folders["gpt2"], "GPT2Config", 8192, **gpt2)
    save_llama3_tokenizer(folders["llama3_rope"])
    # 7 layers: llama.cpp's Gemma 3 has every 6th layer global, as transformers' default layer_types
    save_random_model(folders["gemma3"], "Gemma3TextConfig", 8192, num_hidden_layers=7, head_dim=32,
                      query_pre_attn_scalar=32, sliding_window=5, final_logit_softcapping=3.0)  # fmt: skip
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
    save_random_model(folders["llama3_rope"], "LlamaConfig", 8192, rope_scaling=llama3, rope_theta=500000.0,
                      tie_word_embeddings=True)  # fmt: skip
    jobs = [("embedded", t) for t in ("f32", "f16", "bf16")]
    jobs += [
        ("qwen2", "bf16"),
        ("qwen3", "f32"),
        ("gemma3", "f32"),
        ("llama3_rope", "f32"),
        ("spm", "f32"),
        ("gemma3_spm", "f32"),
        ("gpt2", "f32"),
        ("yarn", "f32"),
    ]
    pre = {"qwen2": "qwen2", "qwen3": "qwen2", "yarn": "qwen2", "llama3_rope": "llama-bpe"}
    out = {f"{name}-{outtype}": (folders[name], root / f"{name}-{outtype}.gguf") for name, outtype in jobs}
    convert(
        [
            {
                "model": str(folders[name]),
                "out": str(out[f"{name}-{t}"][1]),
                "outtype": t,
                "pre": pre.get(name, "gpt-2"),
            }
            for name, t in jobs
        ]  # fmt: skip
    )
    return out


UNQUANTIZED = ["embedded-f32", "embedded-f16", "embedded-bf16", "qwen2-bf16", "qwen3-f32", "gemma3-f32",
               "llama3_rope-f32", "spm-f32", "gemma3_spm-f32", "gpt2-f32", "yarn-f32"]  # fmt: skip


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_gguf_logits_equal_the_hf_folders(files, name):
    folder, gguf_file = files[name]
    ours, cfg, _ = load_model(str(gguf_file), dtype="float32", prepack=False)
    ref, ref_cfg, _ = load_model(str(folder), dtype="float32", prepack=False)
    differ = {
        field: (getattr(cfg, field), getattr(ref_cfg, field))
        for field in cfg.__dataclass_fields__
        if getattr(cfg, field) != getattr(ref_cfg, field)
    }
    differ.pop("dtype", None)  # the file's, by its --outtype
    # llama.cpp's end-of-generation ids: the original's, and control tokens that end a turn in some family
    assert set(cfg.eos_token_ids) >= set(ref_cfg.eos_token_ids)
    differ.pop("eos_token_ids", None)
    if name.startswith("llama3_rope"):  # the file holds the scaling as per-frequency divisors
        assert cfg.rope.freq_factors is not None and ref_cfg.rope.rope_type == "llama3"
        differ.pop("rope")
    assert differ == {}
    ids = [0, *range(5, cfg.vocab_size, cfg.vocab_size // 80)]
    a, b = forward_logits(ours, ids), forward_logits(ref, ids)
    # f16 from a bf16 model changes only values below f16's normal range; f32 and bf16 are bit-exact
    # copies, and Llama 3's rope divisors are stored in float32
    tol = 1e-3 if "f16" in name and "bf16" not in name else 1e-4
    assert (a - b).abs().max() <= tol * a.abs().max(), name
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("name", ["embedded-bf16", "qwen2-bf16", "llama3_rope-f32"])
def test_gguf_tokenizer_encodes_and_renders_as_the_original(files, name):
    folder, gguf_file = files[name]
    ours, ref = load_tokenizer(gguf_file), Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids) == ref.decode(ids)
            assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.vocab_size == ref.vocab_size
    assert ours.eos_token_ids >= ref.eos_token_ids
    assert {ours.id_to_token(i) for i in ours.eos_token_ids - ref.eos_token_ids} <= EOG_TEXTS
    assert ours.all_special_ids == ref.all_special_ids
    # the file may name a BOS the original leaves unnamed (from config.json's bos_token_id), never another
    assert ref.special_tokens.items() <= ours.special_tokens.items()
    for generation in (True, False):
        assert ours.apply_chat_template(MESSAGES, generation) == ref.apply_chat_template(MESSAGES, generation)


def test_the_race_cuts_its_prompts_with_the_files_own_tokenizer(files):
    """`infer bench race X.gguf` counts prompt tokens as infer serve X.gguf does: with the file's tokenizer,
    not the embedded model's (a GGUF file has no tokenizer.json beside it)."""
    folder, gguf_file = files["qwen2-bf16"]
    args = argparse.ArgumentParser()
    race.add_arguments(args)
    path, override = race.model_and_tokenizer(args.parse_args([str(gguf_file)]))
    assert (path, override) == (gguf_file, None)
    ref = Tokenizer.from_pretrained(folder)
    prompts = exact_prompts(load_tokenizer(path, override), 8, 64, seed=0)
    assert [len(ref.encode(p)) for p in prompts] == [64] * 8
    flags = args.parse_args([str(gguf_file), f"--infer-flags=--tokenizer {EMBEDDED_MODEL}"])
    assert race.model_and_tokenizer(flags)[1] == str(EMBEDDED_MODEL)


@pytest.mark.parametrize("name", ["spm-f32", "gemma3_spm-f32"])
def test_sentencepiece_vocabulary_encodes_as_sentencepiece(files, name):
    """A `llama` (SentencePiece) vocabulary: ids as the tokenizer.model it was converted from gives them,
    as llama.cpp does, with Llama 2's "▁" prepended or Gemma's without. (transformers 5's own reading of
    a Llama 2 folder differs on text that starts with spaces: its Metaspace adds no "▁" before one,
    SentencePiece and llama.cpp do.)"""
    import sentencepiece

    folder, gguf_file = files[name]
    ours = load_tokenizer(gguf_file)
    original = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ref = Tokenizer.from_pretrained(folder)
    assert ours.vocab_size == ref.vocab_size >= original.vocab_size()  # transformers may add tokens
    for text in [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"]:
        ids = original.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [original.bos_id(), *ids]
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids), text
    assert ours.eos_token_ids >= ref.eos_token_ids >= {original.eos_id()}
    assert {ours.id_to_token(i) for i in ours.eos_token_ids - ref.eos_token_ids} <= EOG_TEXTS
    assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES)


def test_a_transformers_tokenizer_agrees_on_the_ids(files):
    """The reference is transformers' own reading of the original folder, not only ours."""
    from transformers import AutoTokenizer

    folder, gguf_file = files["qwen2-bf16"]
    ours, ref = load_tokenizer(gguf_file), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text


def test_split_files_and_a_folder_load_as_one_file(files, tmp_path):
    folder, gguf_file = files["embedded-f32"]
    convert([{"model": str(folder), "out": str(tmp_path / "emb.gguf"), "outtype": "f32", "pre": "gpt-2",
              "args": ["--split-max-tensors", "20"]}])  # fmt: skip
    splits = sorted(tmp_path.glob("emb-*-of-*.gguf"))
    assert [p.name for p in splits] == [f"emb-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, _, _ = load_model(str(gguf_file), dtype="float32", prepack=False)
    for model in (splits[0], tmp_path):  # the first split, and the folder holding them
        assert resolve_model_path(str(model)) == splits[0]
        split, _, _ = load_model(str(model), dtype="float32", prepack=False)
        for (name, a), (_, b) in zip(whole.state_dict().items(), split.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    splits[2].unlink()
    with pytest.raises(ValueError, match="emb-00003-of-00003.gguf is missing"):
        load_model(str(splits[0]))


def test_llm_serves_the_gguf_as_its_folder(files):
    from infer.engine.llm import LLM
    from infer.sampling_params import SamplingParams

    folder, gguf_file = files["embedded-bf16"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = "In the beginning God created"
    ref = LLM(str(folder), dtype="float32", num_kv_blocks=64).generate(prompt, params)[0]
    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids and out.text == ref.text
    gguf = llm.engine.quantization["gguf"]
    assert gguf["architecture"] == "llama" and gguf["tensor_types"]["BF16"] > 0
    overridden = LLM(str(gguf_file), tokenizer=str(folder), dtype="float32", num_kv_blocks=64)
    assert overridden.engine.tokenizer.name == folder.name


@pytest.mark.parametrize("name", ["embedded-f32", "qwen2-bf16"])
def test_tensor_parallel_shards_of_a_gguf_are_the_folders(files, name):
    """Each rank reads its slice of every GGUF tensor (q/k rows put back first), as from safetensors."""
    from infer.layers.parallel import TensorParallel

    folder, gguf_file = files[name]
    for rank in (0, 1):
        tp = TensorParallel(rank, 2)
        ours, _, _ = load_model(str(gguf_file), dtype="float32", prepack=False, tp=tp)
        ref, _, _ = load_model(str(folder), dtype="float32", prepack=False, tp=tp)
        for (key, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items(), strict=True):
            assert torch.equal(a, b), (rank, key)


def test_server_says_what_the_file_held(files, tmp_path):
    """The start-up log and /server_info: the architecture and the tensor types with their counts."""
    import httpx

    from tests.server.conftest import ServerProcess

    _, gguf_file = files["embedded-bf16"]
    args = ["--model", str(gguf_file), "--enforce-eager", "--num-kv-blocks", "64"]
    server = ServerProcess(args, tmp_path / "server.log").start()
    try:
        held = httpx.get(server.url + "/server_info").json()["quantization"]["gguf"]
        body = {"model": str(gguf_file), "prompt": "And the LORD said", "max_tokens": 8, "temperature": 0}
        completion = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        log = server.log_tail(100_000)
    finally:
        server.stop()
    assert held["architecture"] == "llama" and held["file"] == "embedded-bf16.gguf"
    assert held["tensor_types"] == {"BF16": 43, "F32": 13}  # matrices in bf16, norms kept in f32
    assert "GGUF embedded-bf16.gguf: architecture llama, tensors BF16 x43, F32 x13" in log
    assert completion["choices"][0]["text"] == " unto Moses, Go up, and let"  # the embedded model's words
