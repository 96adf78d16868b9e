"""Proposals of a chosen acceptance, for measuring speculative decoding on a model that accepts nothing.

Random weights (a model's shape, `--load-format dummy`) never repeat their prompt nor agree with a
draft, so neither n-gram nor a draft model shows what a verification step costs or what speculation buys
at a given acceptance. This proposer knows the target's own greedy continuation of each prompt (taken
from a plain greedy run first, `learn`) and proposes it, right at each position with probability
`acceptance` until the first wrong proposal (a geometric number right), and wrong from there on:

    acceptance a   accepted at position j of the K: a**j of the verifications
                   a = 1.0: every proposal accepted; a = 0: none (the verification's whole cost, no gain)

A wrong proposal is the true token + 1 (mod the vocabulary): never the argmax, so it is rejected at
temperature 0, and greedy output stays the plain run's. The draws are a function of (prompt, position),
so repeats of a workload propose the same tokens and count the same. For the micro-benchmark only: the
server has no way to select it (`speculative_decoding.run_oracle` puts it on the engines it builds).
"""

from __future__ import annotations

import random


class OracleProposer:
    """`propose(token_ids, max_tokens)` as NgramProposer's; acceptance None proposes nothing (plain
    decoding on the same engine)."""

    def __init__(self, num_speculative_tokens: int, vocab_size: int, acceptance: float | None = 1.0):
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.acceptance = acceptance
        self._by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}  # prompt length -> prompt -> tokens

    def learn(self, prompt_ids, continuation) -> None:
        """The target's greedy continuation of this prompt (its plain run's output tokens)."""
        self._by_length.setdefault(len(prompt_ids), {})[tuple(prompt_ids)] = list(continuation)

    def continuation(self, token_ids) -> tuple[str, list[int], int] | None:
        """The learned prompt that token_ids start with (as a key), its continuation, and how many of
        its tokens token_ids already hold; None for a prompt never learned."""
        for length, prompts in self._by_length.items():
            tokens = prompts.get(tuple(token_ids[:length]))
            if tokens is not None:
                return f"{length}:{hash(tuple(token_ids[:length]))}", tokens, len(token_ids) - length
        return None

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        found = None if self.acceptance is None or k <= 0 else self.continuation(token_ids)
        if found is None:
            return []
        key, tokens, done = found
        truth = tokens[done : done + k]
        draws = random.Random(f"{key}:{done}")  # the same proposals in every repeat
        right = 0
        while right < len(truth) and draws.random() < self.acceptance:
            right += 1
        return truth[:right] + [(t + 1) % self.vocab_size for t in truth[right:]]
