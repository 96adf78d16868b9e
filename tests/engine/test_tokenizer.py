"""Tokenizer and incremental detokenizer against transformers, on tokenizers built here (no download).

Two fixture tokenizers cover the two ways a character spans several tokens:
- byte-level BPE (GPT-2 / Llama 3 / Qwen style), trained on accents, CJK and emoji with a small vocab;
- SentencePiece-style BPE with byte fallback and a decoder that strips the first leading space
  (Llama 2 style), where decode(suffix) != suffix of decode.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Héllo wörld, café naïve résumé. ",
    "你好，世界！今天天气很好。日本語のテキストです。",
    "Emoji time 😀🎉👍🏽 and more 🚀 ",
    "The quick brown fox jumps over the lazy dog. ",
    "Ünïcödé stress tëst: ½ ¾ € £ ¥ ",
]
SPECIALS = ["<unk>", "</s>", "<s>", "<pad>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Héllo wörld, 你好世界! 😀🎉 café",
    "The lazy dog jumps over the quick brown fox 🚀🚀",
    "  leading spaces and trailing  ",
    "日本語のテキストです。Ünïcödé ½ € 👍🏽",
    "a <|im_end|> special token inside text",
    "",
]
TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}
{%- else %}{% set system = none %}{% set rest = messages %}{% endif -%}
{{ bos_token }}
{%- if system is not none or tools is not none %}<|im_start|>system
{{ system if system is not none else '' }}
{%- if tools is not none %}

Tools: {{ tools | tojson }}
{%- endif %}<|im_end|>
{% endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in rest %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{% endgeneration %}
{%- else %}{{ message.content }}{% endif %}
{%- if message.reasoning_content is defined %} [thought: {{ message.reasoning_content }}]{% endif %}
{%- if message.tool_calls is defined %} [calls: {{ message.tool_calls | length }}]{% endif %}<|im_end|>
    {%- if ns.turns > 50 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}
{{- eos_token if false else '' }}"""
CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Wie geht's? 你好"},
        {"role": "assistant", "content": "  Gut, danke 😀  ", "tool_calls": None},
        {"role": "user", "content": "Und dir?"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "42", "reasoning": "6 × 7 = 42"},
        {"role": "user", "content": "Thanks"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Wetter für eine Stadt ☀️"}}]


def _write_folder(path, backend, config, generation_config=None):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def _byte_level_backend(post_processor=True):
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    if post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return backend


def _sentencepiece_style_backend():
    """Llama 2's tokenizer.json layout: ▁ for spaces, byte fallback, decoder strips one leading space."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzTH.,!", "▁t", "▁th", "▁the", "▁a", "he", "ll", "llo"]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a"), ("h", "e"), ("l", "l"), ("ll", "o")]
    backend = HFBackend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.add_special_tokens(SPECIALS)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return backend


BASE_CONFIG = {
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False},
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "chat_template": TEMPLATE,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytelevel")
    return _write_folder(root, _byte_level_backend(), BASE_CONFIG, {"eos_token_id": [1, 5]})


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf_tok(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    folder = _write_folder(tmp_path_factory.mktemp("sp"), _sentencepiece_style_backend(), BASE_CONFIG)
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


# -- encode / decode / properties -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, sp_tok, text):
    for ours, theirs in ((tok, hf_tok), sp_tok):
        assert ours.encode(text) == theirs(text)["input_ids"]
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_fixture_splits_characters_across_tokens(tok, sp_tok):
    for t in (tok, sp_tok[0]):
        pieces = [t.decode([i]) for i in t.encode("你好😀é", add_special_tokens=False)]
        assert any("\ufffd" in p for p in pieces)  # otherwise the streaming tests prove nothing


def test_properties(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == 2
    assert tok.eos_token_id == hf_tok.eos_token_id == 1
    assert tok.eos_token_ids == {1, 5}  # tokenizer eos + generation_config.json
    assert tok.vocab_size == len(hf_tok)
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids
    assert tok.all_special_ids == set(range(len(SPECIALS)))
    assert tok.encode("<s>", add_special_tokens=False) == [2]


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_split_special_tokens(tmp_path):
    folder = _write_folder(tmp_path, _byte_level_backend(), {**BASE_CONFIG, "split_special_tokens": True})
    ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.encode("x<|im_end|>") == theirs("x<|im_end|>")["input_ids"]
    assert 5 not in ours.encode("x<|im_end|>")


def test_add_bos_token_applies_without_post_processor(tmp_path):
    folder = _write_folder(
        tmp_path, _byte_level_backend(post_processor=False), {**BASE_CONFIG, "add_bos_token": True}
    )
    ours = Tokenizer.from_pretrained(folder)
    assert ours.encode("hi")[0] == 2 and ours.encode("hi", add_special_tokens=False)[0] != 2


# -- chat templates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, chat, add_generation_prompt):
    for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, **kwargs)
        theirs = hf_tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert ours == theirs
    assert "☀️" in tok.apply_chat_template(chat, tools=TOOLS)  # tojson keeps non-ASCII


@pytest.mark.parametrize(
    ("content", "end"),
    [
        ("  Gut, danke 😀  ", "assistant\nGut, danke 😀"),  # the template trims it: so does the cut
        ("In the beginning", "assistant\nIn the beginning"),
        ([{"type": "text", "text": "A "}], "'text': 'A "),  # this template writes the parts as they are
    ],
)
def test_continue_final_message_matches_transformers(tok, hf_tok, content, end):
    """The final message left open (vLLM's continue_final_message, which calls transformers' rule): the
    rendering ends inside it, without its end of turn. Refused with a generation prompt or without text
    to continue, as by transformers."""
    chat = [*CHATS[0], {"role": "assistant", "content": content}]
    ours = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.endswith(end) and chat[-1]["content"] == content
    with pytest.raises(ValueError, match="not compatible"):
        tok.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match='no "content" to continue'):
        tok.apply_chat_template([{"role": "user"}], add_generation_prompt=False, continue_final_message=True)


def test_template_files_and_named_templates(tmp_path, tok):
    named = [
        {"name": "default", "template": "D{{ messages[0].content }}{{ image_token }}"},
        {"name": "tool_use", "template": "T"},
    ]
    config = {**BASE_CONFIG, "chat_template": named, "image_token": "<img>"}  # a model-specific token
    folder = _write_folder(tmp_path / "named", _byte_level_backend(), config)
    ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    msgs = CHATS[0]
    assert ours.encode("a<img>b") == theirs("a<img>b")["input_ids"] and ours.vocab_size == len(theirs)
    for kwargs in ({}, {"tools": TOOLS}):
        assert ours.apply_chat_template(msgs, **kwargs) == theirs.apply_chat_template(
            msgs, tokenize=False, **kwargs
        )
    assert ours.apply_chat_template(msgs, tools=TOOLS) == "T"
    assert ours.apply_chat_template(msgs) == "DHi there!<img>"

    (folder / "chat_template.jinja").write_text("J{{ bos_token }}{{ messages | length }}")  # replaces config
    ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs, tokenize=False) == "J<s>1"


def test_chat_template_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="Unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])
    config = {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"}
    plain = Tokenizer.from_pretrained(_write_folder(tmp_path, _byte_level_backend(), config))
    assert plain.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(CHATS[0])


# -- incremental detokenization ---------------------------------------------------------------------


def _stream(
    tokenizer, ids, chunk_sizes=None, stop=(), skip_special_tokens=True, include_stop_str=False, spaces=True
):
    """Feed `ids` in chunks; return (deltas, detokenizer) with the flushed tail as the last delta."""
    detok = IncrementalDetokenizer(
        tokenizer,
        [2, 7],
        skip_special_tokens=skip_special_tokens,
        stop=stop,
        include_stop_str=include_stop_str,
        spaces_between_special_tokens=spaces,
    )
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.update(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas, detok


def _random_chunks(rng, n):
    return [rng.randint(1, 5) for _ in range(n)]


@pytest.mark.parametrize("text", TEXTS[:5])
def test_streaming_equals_one_shot_decode(tok, sp_tok, text):
    for t in (tok, sp_tok[0]):
        ids = t.encode(text, add_special_tokens=False)
        for seed in (None, 0, 1, 2):
            chunks = None if seed is None else _random_chunks(random.Random(seed), len(ids))
            deltas, detok = _stream(t, ids, chunks)
            assert "".join(deltas) == t.decode(ids) == detok.output_text
            assert not any("\ufffd" in d for d in deltas)
            assert detok.num_output_tokens == len(ids)


def test_streaming_handles_prefix_dependent_decoders(sp_tok):
    t = sp_tok[0]
    ids = t.encode("the cat ate a hello", add_special_tokens=False)
    naive = "".join(t.decode([i]) for i in ids)
    assert naive != t.decode(ids)  # the decoder strips the first space of every separate decode
    assert "".join(_stream(t, ids)[0]) == t.decode(ids)


def test_streaming_special_tokens(tok):
    ids = tok.encode("héllo <|im_end|><s> wörld 😀", add_special_tokens=False)
    for skip in (True, False):
        deltas, _ = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def _vllm_fast_detokenizer(tokenizer, ids, spaces: bool) -> str:
    """vLLM 0.32's FastIncrementalDetokenizer on the output ids (special tokens shown): tokenizers'
    DecodeStream, and with spaces_between_special_tokens False an added token after another as its own
    text (vllm/v1/engine/detokenizer.py, decode_next)."""
    stream, text, last_added = decoders.DecodeStream(skip_special_tokens=False), "", False
    for token_id in ids:
        piece = stream.step(tokenizer._backend, token_id)
        added = token_id in tokenizer.added_tokens
        if not spaces and added and last_added:
            piece = tokenizer.added_tokens[token_id]
        text, last_added = text + (piece or ""), added
    return text


def test_spaces_between_special_tokens_as_vllm(folder):
    """vLLM's spaces_between_special_tokens: a tokenizer without a decoder joins tokens with a space, as
    WordPiece's does; False writes an added token that follows another as its own text. Equal to vLLM's
    rule in every chunking; no effect while special tokens are skipped (nor with byte-level's decoder)."""
    tokenizer = Tokenizer.from_pretrained(folder)
    tokenizer._backend.decoder = None
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    ids = [start, end, *tokenizer.encode("hi there", add_special_tokens=False), end, end, start]
    shown = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_end|> <|im_end|> <|im_start|>" in shown  # the decoder's spaces
    rng = random.Random(5)
    for spaces in (True, False):
        expected = _vllm_fast_detokenizer(tokenizer, ids, spaces)
        for chunks in (None, _random_chunks(rng, len(ids))):
            deltas, _ = _stream(tokenizer, ids, chunks, skip_special_tokens=False, spaces=spaces)
            assert "".join(deltas) == expected
    assert expected.startswith("<|im_start|><|im_end|> ") and expected.endswith(
        "<|im_end|><|im_end|><|im_start|>"
    )
    assert "".join(_stream(tokenizer, ids, spaces=False)[0]) == tokenizer.decode(ids)
    byte_level = Tokenizer.from_pretrained(folder)
    deltas, _ = _stream(byte_level, ids, skip_special_tokens=False, spaces=False)
    assert "".join(deltas) == byte_level.decode(ids, skip_special_tokens=False)


def test_streaming_random_ids_equals_decode(tok):
    # Byte-level BPE: exact even for garbage ids (invalid UTF-8 included; flush releases the tail).
    rng = random.Random(7)
    for _ in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas, _ = _stream(tok, ids, _random_chunks(rng, len(ids)))
        assert "".join(deltas) == tok.decode(ids)


def test_streaming_random_text_byte_fallback(sp_tok):
    # Byte fallback is exact on valid UTF-8 (see the detokenizer docstring for invalid byte runs).
    t, rng = sp_tok[0], random.Random(8)
    alphabet = ["a", "the", " ", "é", "世", "😀", "<|im_end|>", "hello", "!"]
    for _ in range(60):
        ids = t.encode(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))), add_special_tokens=False
        )
        for skip in (True, False):
            deltas, _ = _stream(t, ids, _random_chunks(rng, len(ids)), skip_special_tokens=skip)
            assert "".join(deltas) == t.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_held_until_flush(tok):
    ids = tok.encode("ok😀", add_special_tokens=False)
    deltas, _ = _stream(tok, ids[:-1])  # cut inside the emoji
    assert all("\ufffd" not in d for d in deltas[:-1]) and deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == tok.decode(ids[:-1])


def test_work_per_update_is_bounded(tok):
    class Counting:
        all_special_ids = tok.all_special_ids
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode("Héllo wörld 你好世界 😀🎉 " * 40, add_special_tokens=False)
    deltas, _ = _stream(Counting(), ids)
    assert "".join(deltas) == tok.decode(ids)
    assert Counting.decoded < 12 * len(ids)  # O(tokens), not O(tokens^2)


# -- stop strings --------------------------------------------------------------------------------------


def _run_stop(t, text, stop, seed=None, include_stop_str=False):
    ids = t.encode(text, add_special_tokens=False)
    chunks = None if seed is None else _random_chunks(random.Random(seed), len(ids))
    deltas, detok = _stream(t, ids, chunks, stop=stop, include_stop_str=include_stop_str)
    return "".join(deltas), detok, deltas


@pytest.mark.parametrize("seed", [None, 3, 4])
def test_stop_strings(tok, seed):
    out, d, _ = _run_stop(tok, "Héllo wörld. Stop here please", ["Stop"], seed)
    assert (out, d.stopped, d.stop_str) == ("Héllo wörld. ", True, "Stop")
    out, d, _ = _run_stop(tok, "Héllo wörld. Stop here please", ["please", "wörld"], seed)
    assert (out, d.stop_str) == ("Héllo ", "wörld")  # the earliest match wins
    out, d, _ = _run_stop(tok, "你好世界😀 more", ["世界😀"], seed)  # the stop spans several tokens
    assert (out, d.stopped) == ("你好", True)
    out, d, _ = _run_stop(tok, "STOP right away", ["STOP"], seed)
    assert (out, d.stopped) == ("", True)
    out, d, _ = _run_stop(tok, "xabc y", ["bc", "abc"], seed)  # both complete on "c": cut at the first
    assert (out, d.stop_str) == ("x", "abc")


def test_stop_partial_match_is_held_then_released(tok):
    out, d, deltas = _run_stop(tok, "hello world", ["world peace"])
    assert not d.stopped and out == "hello world"
    assert deltas[-1].endswith("world") and "world" not in "".join(deltas[:-1])  # held until flush
    out, d, _ = _run_stop(tok, "hello worldwide", ["world peace"])
    assert not d.stopped and out == "hello worldwide"


def test_updates_after_stop_are_ignored(tok):
    ids = tok.encode("abc END def", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    out = detok.update(ids)
    assert out == "abc " and detok.stopped and detok.num_output_tokens < len(ids)
    assert detok.update(ids) == "" and detok.flush() == ""


def test_stop_random_property(tok):
    rng = random.Random(11)
    alphabet = ["a", "b", " ", "é", "世", "😀"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))
        ]
        full = tok.decode(tok.encode(text, add_special_tokens=False))
        out, d, deltas = _run_stop(tok, text, stop, seed=rng.randrange(100))
        assert full.startswith(out) and not any(s in out for s in stop)
        if d.stopped:
            assert full[len(out) :].startswith(d.stop_str)
        else:
            assert out == full and not any(s in full for s in stop)
        assert not any("\ufffd" in x for x in deltas)
        kept, k, _ = _run_stop(tok, text, stop, seed=rng.randrange(100), include_stop_str=True)
        assert (kept, k.stop_str) == (
            out + (d.stop_str or ""),
            d.stop_str,
        )  # vLLM's include_stop_str_in_output


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])


def test_a_model_loaded_again_reuses_its_tokenizer_until_its_files_change(tmp_path, monkeypatch):
    """A server of several models loads each one many times: its tokenizer is built once, and again only
    once a file it was read from has changed."""
    import os
    import shutil

    from infer.engine import tokenizer as tokenizer_module
    from infer.engine.tokenizer import load_tokenizer
    from infer.models.loader import EMBEDDED_MODEL

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, folder / name)
    builds = []
    build = tokenizer_module.Tokenizer.from_pretrained
    monkeypatch.setattr(tokenizer_module.Tokenizer, "from_pretrained", lambda f: builds.append(f) or build(f))
    first = load_tokenizer(folder)
    assert load_tokenizer(folder) is first and len(builds) == 1
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}!"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    os.utime(folder / "tokenizer_config.json", ns=(1, 1))  # a new modification time on a coarse clock
    again = load_tokenizer(folder)
    assert again is not first and len(builds) == 2
    assert again.encode("In the beginning") == first.encode("In the beginning")
