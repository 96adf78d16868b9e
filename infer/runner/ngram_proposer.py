"""N-gram (prompt lookup) proposals for speculative decoding: no draft model, only the sequence itself.

A text that quotes, edits or summarises its prompt repeats it: when the sequence's last n tokens occurred
earlier (in the prompt or the output), the tokens that followed them then are a good guess for what
follows now. As vLLM's proposer: the longest n in [prompt_lookup_min, prompt_lookup_max] that matches
wins, and among the matches of that n the earliest; up to k tokens after it are proposed.

    tokens:  [ 1 2 3 4 1 2 3 ]     n = 2: the suffix [2 3] first occurs at 1
                 ^^^               proposals: tokens[3:3 + k] = [4 1 2] for k = 3

Vectorised (numpy): the earlier copies of the last token are found in one comparison, then each is
extended backwards one token at a time, up to max_n: O(len(tokens) + copies * max_n) per proposal.
"""

from __future__ import annotations

import numpy as np


def find_ngram_proposal(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of tokens' longest matching suffix
    (of min_n..max_n tokens); [] when no suffix in that range occurs earlier, or k <= 0."""
    tokens = np.asarray(tokens)
    num = len(tokens)
    if k <= 0 or num < min_n + 1:
        return []
    # where an occurrence could end: an earlier copy of the last token (the suffix itself does not count)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    lengths = np.ones(len(ends), dtype=np.int64)  # how far back each occurrence matches, up to max_n
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):
        before = ends - m
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[num - 1 - m]
        if not alive.any():
            break
        lengths += alive
    if not len(ends) or lengths.max() < min_n:
        return []
    first = int(np.argmax(lengths == lengths.max()))  # the earliest of the longest
    start = int(ends[first]) + 1
    return tokens[start : start + k].tolist()


class NgramProposer:
    """Proposals for one request's sequence at a time (`propose`), with a SpeculativeConfig's bounds."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """At most min(k, max_tokens) proposals to follow token_ids (the prompt and the output so far)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        return find_ngram_proposal(token_ids, self.min_n, self.max_n, k)
