"""A Hugging Face tokenizer folder, read without transformers.

`Tokenizer.from_pretrained(folder)` reads the same files `AutoTokenizer` reads and behaves as transformers 5
does on them:

- `tokenizer.json` is the tokenizer (the `tokenizers` library runs it). Its post-processor decides which
  special tokens `encode(text)` adds; transformers 5 ignores `add_bos_token` / `add_eos_token` when that
  file exists. We honour them only where `tokenizer.json` has no post-processor (the transformers 4 rule
  for Llama-style tokenizers, so an old checkpoint still gets its BOS).
- `tokenizer_config.json` names the special tokens (a string or an AddedToken-style dict) and may hold the
  chat template: a string, or a list of `{"name", "template"}`.
- `chat_template.jinja` and `additional_chat_templates/*.jinja` (what transformers 5 saves) replace the
  templates of `tokenizer_config.json` when present.
- `generation_config.json` and `config.json` add EOS ids: instruct models stop on several tokens
  (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>; Gemma 3: <eos>, <end_of_turn>).

Chat templates render in the sandbox transformers uses, with its globals and filters, so a prompt is
byte-identical to `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

from infer.engine.chat_template import (
    compile_template,
    continue_final,
    plain,
    render,
    tag_final_message,
    with_reasoning_aliases,
)
from infer.models.gguf import is_gguf, open_gguf
from infer.models.loader import tokenizer_folder

# The named special tokens transformers passes to a chat template (its `special_tokens_map`).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# The tokenizers library's batch calls release the GIL while they work, its single calls do not: a 4 MB
# prompt tokenized on a server's worker thread held every other thread for 2.4 s with `encode`, and for
# at most 0.14 s (building the Python list) with `encode_batch`. Short inputs keep the cheaper single call.
LONG_TEXT = 1 << 14


class Tokenizer:
    """Text <-> token ids, the model's chat template, and the ids that end generation.

    Build it with `from_pretrained`. Immutable after construction; safe to share between requests.
    """

    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str],
        chat_templates: str | Mapping[str, str] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        name: str = "",
    ):
        self._backend = backend
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens)  # named tokens, e.g. {"bos_token": "<s>"}
        self._chat_templates = chat_templates
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        eos_ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids | set(extra_eos_token_ids))
        named_ids = {self._id_of(token) for token in self.special_tokens.values()} - {None}
        added = backend.get_added_tokens_decoder()
        self.added_tokens: dict[int, str] = {i: token.content for i, token in added.items()}
        # Exactly the ids `decode(..., skip_special_tokens=True)` drops.
        self.all_special_ids: frozenset[int] = frozenset(
            {i for i, token in added.items() if token.special} | named_ids
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{str(folder)!r} has no tokenizer.json; infer reads only the fast-tokenizer file "
                "(convert a slow tokenizer with transformers: AutoTokenizer.from_pretrained(...)"
                ".save_pretrained(folder))"
            )
        config = _read_json(folder / "tokenizer_config.json")
        legacy = _read_json(folder / "special_tokens_map.json")
        if "added_tokens_decoder" not in config:  # old folders keep their special tokens there
            config.update(legacy)
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise ValueError(f"cannot read {path}: {e}") from e
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        special_tokens, to_add = _named_special_tokens(config)
        # As transformers does: a named special token missing from the added tokens becomes one, so that
        # encode matches it whole and decode can skip it.
        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = [token for token in to_add if token.content not in present]
        if missing:
            backend.add_special_tokens(missing)

        if backend.post_processor is None:
            add_bos = bool(config.get("add_bos_token")) and "bos_token" in special_tokens
            add_eos = bool(config.get("add_eos_token")) and "eos_token" in special_tokens
            if add_bos or add_eos:
                backend.post_processor = bos_eos_processor(backend, special_tokens, add_bos, add_eos)

        return cls(
            backend,
            special_tokens,
            _load_chat_templates(folder, config.get("chat_template")),
            _model_eos_ids(folder),
            name=folder.name,  # in messages to clients: the folder's name, not where it is
        )

    # -- text <-> ids ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; equals transformers' `tokenizer(text)["input_ids"]`.

        Text that is already a rendered chat prompt carries its own BOS: encode it with
        `add_special_tokens=False` (as transformers' `apply_chat_template(tokenize=True)` does).
        Special-token text inside `text` (e.g. "<|eot_id|>") becomes the special token's id.
        """
        if len(text) > LONG_TEXT:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(
        self, text: str, text_pair: str | None = None, max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """(token ids, token type ids) of a text or a pair of texts with the special tokens around and
        between them, as transformers' `tokenizer(text, text_pair)`; with max_length, the texts are cut
        to fit it (the longer one first, from its end: transformers' `truncation=True`)."""
        first = self._backend.encode(text, add_special_tokens=False)
        second = self._backend.encode(text_pair, add_special_tokens=False) if text_pair is not None else None
        if max_length is not None:
            room = max(max_length - self._backend.num_special_tokens_to_add(second is not None), 0)
            a, b = len(first.ids), len(second.ids) if second is not None else 0
            if a + b > room:  # the longer is cut down to the shorter, then both by turns
                short = min(a, b)
                a, b = (room - short, short) if a > b else (short, room - short)
                if min(a, b) < 0 or short > room - short:
                    a, b = room - room // 2, room // 2
            first.truncate(a)
            if second is not None:
                second.truncate(b)
        encoding = self._backend.post_process(first, second, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) > LONG_TEXT:
            return self._backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the size of the embedding the ids index)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, added tokens included, without padding or truncation (what
        llguidance reads to map its grammars onto tokens: infer.structured_outputs)."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- chat ---------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default template, or None when the model has none."""
        if isinstance(self._chat_templates, Mapping):
            return self._chat_templates.get("default")
        return self._chat_templates

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        max_chars: int = 1 << 30,
        **extra: Any,
    ) -> str:
        """Render `messages` to the prompt text, exactly as transformers'
        `apply_chat_template(messages, tokenize=False, ...)` does.

        Message keys whose value is None are dropped (templates test for a missing key, not for None).
        `extra` becomes template variables (e.g. `enable_thinking=False` for Qwen3) and overrides the
        special tokens of the same name. `chat_template` is a template name (when the model has several)
        or a Jinja template. A prompt longer than `max_chars` is refused (ValueError) as soon as rendering
        passes it. `continue_final_message`: the prompt ends inside the last message, for the model to go
        on with it (`continue_final`). Does not mutate `messages`.
        """
        if not messages:
            raise ValueError("messages is empty: a chat needs at least one message")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ValueError(f"each message must be an object with a role and content, got {message!r}")
            chat.append(with_reasoning_aliases(plain({k: v for k, v in message.items() if v is not None})))
        template = self._select_template(chat_template, tools)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message and add_generation_prompt are not compatible: the first "
                    "continues the last message, the second starts a new one"
                )
            final = tag_final_message(chat, template)
        try:
            text = render(
                compile_template(template),
                max_chars,
                messages=chat,
                tools=plain(tools),
                documents=plain(documents),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **plain(extra)},
            )
        except jinja2.TemplateError as e:  # includes raise_exception(...) from the template itself
            raise ValueError(
                f"chat template of {self.name or 'this model'} rejected the messages: {e}"
            ) from e
        return continue_final(text, final) if continue_final_message else text

    def _select_template(self, chat_template: str | None, tools: list | None) -> str:
        templates = self._chat_templates
        if isinstance(templates, Mapping):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"{self.name or 'this model'} has several chat templates and none is named 'default'; "
                f"pick one of {sorted(templates)}"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                f"{self.name or 'this model'} has no chat template (tokenizer_config.json has no "
                "'chat_template' and there is no chat_template.jinja): use the completions API with a "
                "plain prompt, or add a template to the model folder"
            )
        return templates


# -- loading helpers -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _named_special_tokens(config: dict[str, Any]) -> tuple[dict[str, str], list[AddedToken]]:
    """({name: content} of the named special tokens, every special token the config declares).

    Named: the standard ones, any other "<name>_token" (Gemma 3's image_token...) and a dict of
    extra_special_tokens; transformers passes all of them to chat templates by name.
    """
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    keys = [*SPECIAL_TOKEN_KEYS, *(k for k in config if k.endswith("_token") and k not in SPECIAL_TOKEN_KEYS)]
    named = {k: config[k] for k in keys if k in config} | (extra if isinstance(extra, dict) else {})
    special_tokens: dict[str, str] = {}
    declared: list[AddedToken] = []
    for key, value in named.items():
        if (token := _added_token(value)) is not None:
            special_tokens[key] = token.content
            declared.append(token)
    for value in [] if isinstance(extra, dict) else extra:
        if (token := _added_token(value)) is not None:
            declared.append(token)
    return special_tokens, declared


def _model_eos_ids(folder: Path) -> tuple[int, ...]:
    """EOS ids of generation_config.json and config.json (where a multimodal model may nest them)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(folder / name)
        ids += _as_ids(cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id")))
    return tuple(ids)


def _added_token(value: Any) -> AddedToken | None:
    """A special token from a config value: a string, or an AddedToken-style dict with "content"."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=True, **{"normalized": False, **flags})
    return None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def bos_eos_processor(
    backend: _Backend, special_tokens: dict[str, str], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


def _load_chat_templates(folder: Path, from_config: Any) -> str | dict[str, str] | None:
    """transformers 5's rule: template files, when present, replace the templates of tokenizer_config."""
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    if isinstance(from_config, str):
        return from_config
    if isinstance(from_config, list):
        try:
            return {t["name"]: t["template"] for t in from_config}
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                '{"name": ..., "template": ...} objects'
            ) from e
    return None


def load_tokenizer(path: Path, tokenizer: str | None = None):
    """The tokenizer of the model at `path` (resolve_model_path's): `tokenizer`, a folder, overrides it;
    a GGUF file's is built from its metadata (infer.engine.gguf_tokenizer).

    The last few are kept, by the files they were read from as those are now (a Tokenizer is immutable):
    a server of several models builds each one once, not at every load (a large vocabulary's takes a
    good part of a small model's load)."""
    if tokenizer:
        return _cached_tokenizer(Path(tokenizer).expanduser(), False, _files_stamp(Path(tokenizer)))
    source = path if is_gguf(path) else tokenizer_folder(path)
    return _cached_tokenizer(source, is_gguf(source), _files_stamp(source))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _files_stamp(source: Path) -> tuple:
    """What changes when the files a tokenizer is read from change: the size and modification time of a
    GGUF file, or of each file of a folder but its weights."""
    source = source.expanduser()
    files = [source] if source.is_file() else sorted(source.iterdir()) if source.is_dir() else []
    stamp = []
    for f in files:
        if f.is_file() and f.suffix not in WEIGHT_SUFFIXES:
            st = f.stat()
            stamp.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(source: Path, gguf_file: bool, stamp: tuple):
    if gguf_file:
        from infer.engine.gguf_tokenizer import gguf_tokenizer  # the gguf reader: only for a GGUF file

        return gguf_tokenizer(open_gguf(source))
    return Tokenizer.from_pretrained(source)
