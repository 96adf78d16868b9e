"""Token ids -> text deltas for streaming, with stop strings.

Two stages, each holding back text it cannot yet be sure of:

1. Decoding (vLLM's prefix_offset / read_offset technique). Decoding tokens one by one and
   concatenating is wrong twice over: a character can span several tokens (byte-level BPE, byte
   fallback), and some decoders treat the first token of a decode specially (SentencePiece strips the
   leading space), so decode(suffix) != suffix of decode. We therefore always decode a short window that
   starts a few tokens back, and emit only what the new tokens added to that window's text:

       output ids:  . . . . . [ prefix  | read ... new ]
                               ^prefix  ^read          ^end
       prefix_text = decode(ids[prefix:read])      (already emitted)
       text        = decode(ids[prefix:end])
       delta       = text[len(prefix_text):]       emitted unless text ends with U+FFFD (incomplete char)

   After emitting, prefix moves to read and read to end, so the window stays a few tokens long: each
   update costs O(new tokens), not O(output length).

2. Stop strings (infer.engine.stop_strings: one automaton, each character read once). Text that ends
   with the start of a stop string ("wor" for stop "world") is held back until the next text decides
   it; when a stop string appears, the output is cut before it (after it, with include_stop_str, vLLM's
   include_stop_str_in_output). The first stop string to end wins.

Contract: while no stop string matched, "".join(update(...) for each step) + flush() equals
tokenizer.decode(output_ids, skip_special_tokens) exactly (with spaces_between_special_tokens False, but
for what the decoder put before an added token that follows another: see `update`). The output is the
text of the generated ids alone, so streaming and a final one-shot decode agree; the prompt is not part
of the window.
One exception, on invalid UTF-8 only: a byte-fallback decoder (SentencePiece style: Llama 2, Gemma)
turns a whole run of <0xNN> tokens into U+FFFD when the run holds an invalid byte, including bytes that
were valid, and already streamed, before it. Byte-level BPE (Llama 3, Qwen, GPT-2) has no such case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from infer.engine.stop_strings import StopStrings

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class _Decoder(Protocol):
    all_special_ids: frozenset[int]
    added_tokens: Mapping[int, str]  # id -> text of every added token, special or not

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas. One instance per request.

    `prompt_token_ids` is accepted so the engine can hand over the request as it is; the text produced is
    that of the generated ids only (see the module docstring), so the prompt is not decoded.
    Once `stopped` is True, further updates are ignored and return "".
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str: bool = False,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self.num_prompt_tokens = len(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        # decode(skip_special_tokens=True) drops special ids before decoding, so dropping them here is
        # the same and keeps runs of them out of the window.
        self._skipped_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        # vLLM's spaces_between_special_tokens False, as its fast detokenizer has it: in effect only when
        # special tokens are shown, and a no-op for a tokenizer without added tokens
        joined = not (spaces_between_special_tokens or skip_special_tokens)
        self._joined: Mapping[int, str] = tokenizer.added_tokens if joined else {}
        self._last_added = False  # the previous output token is an added token (with _joined only)
        self.stop: tuple[str, ...] = tuple(stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        self._stops = StopStrings(self.stop) if self.stop else None
        self.include_stop_str = include_stop_str  # the text ends with the stop string, not before it

        self._window: list[int] = []  # ids[prefix:], special ids dropped when they are skipped
        self._read = 0  # window index of read_offset
        self._prefix_text = ""  # decode(window[:read])
        self._held = ""  # decoded text held back because it may start a stop string
        self._chunks: list[str] = []

        self.num_output_tokens = 0  # tokens consumed; after a stop, the last one completed the stop string
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._chunks)

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Consume newly generated ids; return the text that is now certain (may be "")."""
        out = []
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.num_output_tokens += 1
            if token_id in self._skipped_ids:
                continue
            self._window.append(token_id)
            after_added, self._last_added = self._last_added, token_id in self._joined
            if after_added and self._last_added and self._read == len(self._window) - 1:
                # an added token after another, spaces_between_special_tokens False: its own text, not
                # the decoder's (which may join tokens with a space). The one before was emitted whole.
                out.append(self._release(self._joined[token_id], final=False))
                self._advance()
                continue
            text = self._tokenizer.decode(self._window, skip_special_tokens=self.skip_special_tokens)
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                out.append(self._release(text[len(self._prefix_text) :], final=False))
                self._advance()
        return self._record("".join(out))

    def flush(self) -> str:
        """The request ended without a stop string: return everything still held back.

        That includes an incomplete character at the end (decoded as U+FFFD, as one-shot decode does).
        """
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self._window, skip_special_tokens=self.skip_special_tokens)
        delta = self._release(text[len(self._prefix_text) :], final=True)
        self._advance()
        return self._record(delta)

    def _advance(self) -> None:
        """prefix_offset <- read_offset, read_offset <- end: keep only the just-emitted ids as context."""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._tokenizer.decode(self._window, skip_special_tokens=self.skip_special_tokens)

    def _release(self, delta: str, final: bool) -> str:
        """Run new text through the stop-string check; return the part that can be emitted."""
        if self._stops is None:
            return delta
        text = self._held + delta
        match = self._stops.feed(delta)
        if match is not None:
            # A stop string cannot start inside text emitted earlier: its start would have been held back.
            end, stop = match  # delta[:end] ends with stop
            self.stopped, self.stop_str, self._held = True, stop, ""
            return text[: len(text) - len(delta) + end - (0 if self.include_stop_str else len(stop))]
        keep = 0 if final else self._stops.partial_len
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
