"""Prompts of real English text cut from a corpus shipped with the project (KJV Genesis, public domain).

Lengths are asked for in tokens and met approximately at ~4 characters per token; the actual counts are the
server's (`usage.prompt_tokens`). With the model's tokenizer at hand, `exact_prompts` meets them exactly.
Each prompt starts at a random word of the corpus, so two prompts share a cached prefix only when a workload
means them to (`shared_prefix`).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "assets" / "toy" / "genesis.txt"
CHARS_PER_TOKEN = 4


@lru_cache(maxsize=4)
def load_corpus(path: Path = CORPUS) -> str:
    text = " ".join(Path(path).read_text(encoding="utf-8").split())  # one line of single-spaced words
    if len(text) < 10_000:
        raise ValueError(f"corpus {path} is too small ({len(text)} chars) to cut prompts from")
    return text


class PromptFactory:
    """Seeded source of prompt text: the same seed gives the same prompts."""

    def __init__(self, seed: int, corpus: str | None = None):
        self.rng = random.Random(seed)
        self.corpus = corpus if corpus is not None else load_corpus()
        self.word_starts = [0] + [m.end() for m in re.finditer(" ", self.corpus)]

    def text(self, num_tokens: int) -> str:
        """About `num_tokens` tokens of consecutive corpus text, starting at a random word."""
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {num_tokens}")
        num_chars = num_tokens * CHARS_PER_TOKEN
        if num_chars >= len(self.corpus):
            raise ValueError(f"{num_tokens} tokens is more text than the corpus holds")
        limit = len(self.corpus) - num_chars
        start = self.word_starts[self.rng.randrange(len(self.word_starts))]
        while start > limit:  # too near the end for this length: draw again
            start = self.word_starts[self.rng.randrange(len(self.word_starts))]
        piece = self.corpus[start : start + num_chars]
        cut = piece.rfind(" ")
        return piece[:cut] if cut > num_chars // 2 else piece

    def shared_prefix(self, num_tokens: int) -> str:
        """A prefix to put in front of many prompts (a 'system prompt'), ending with a blank line."""
        return self.text(num_tokens) + "\n\n"


def exact_prompts(tokenizer, num_prompts: int, num_tokens: int, seed: int, distinct: int = 16) -> list[str]:
    """`num_prompts` corpus texts of exactly `num_tokens` tokens each by `tokenizer`, its special tokens
    included (a BOS, or BERT's [CLS] ... [SEP]: the count a server's `usage.prompt_tokens` reports).

    `tokenizer` has `encode(text, add_special_tokens=True) -> ids` and `decode(ids,
    skip_special_tokens=True) -> text`. A text is cut at a token boundary and kept only when it encodes back
    to the same ids (a cut inside a word may not), and only when its first `distinct` ids differ from every
    kept one's: no two prompts share a cached KV block of `distinct` tokens or more (ours and vLLM's are 16
    or more). The same seed and tokenizer give the same prompts."""
    if num_prompts < 0 or num_tokens < 1:
        raise ValueError(f"need num_prompts >= 0 and num_tokens >= 1, got {num_prompts} and {num_tokens}")
    num_special = len(tokenizer.encode("x")) - len(tokenizer.encode("x", add_special_tokens=False))
    num_text = num_tokens - num_special  # the special tokens the tokenizer adds around a text
    factory = PromptFactory(seed)
    prompts: list[str] = []
    seen: set[tuple[int, ...]] = set()
    attempts = 50 * num_prompts + 100
    while len(prompts) < num_prompts:
        if attempts == 0:
            raise ValueError(
                f"could not cut {num_prompts} distinct prompts of exactly {num_tokens} tokens from the "
                f"corpus (got {len(prompts)}); try another length"
            )
        attempts -= 1
        ids = tokenizer.encode(factory.text(2 * num_tokens), add_special_tokens=False)  # ~4 chars a token
        if len(ids) < num_text or num_text < 0:
            continue
        text = tokenizer.decode(ids[:num_text], skip_special_tokens=True)
        full = tokenizer.encode(text)
        key = tuple(full[:distinct])
        if (
            key not in seen
            and len(full) == num_tokens
            and tokenizer.encode(text, add_special_tokens=False) == ids[:num_text]
        ):
            seen.add(key)
            prompts.append(text)
    return prompts
