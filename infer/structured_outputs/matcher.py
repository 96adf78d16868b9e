"""A request's matcher, step by step: the tokens it consumed, and the bitmask of what each grammar bans next.

    grammar = Grammar(compiler.matcher(spec))
    grammar.advance(output_token_ids)   # each step: the tokens sampled since the last
    bans = banned([grammar, ...], compiler.vocab_size, num_logits)   # bool [rows, num_logits]

Once the grammar is complete, the mask holds only EOS, so a request ends where its grammar does (or at
max_tokens, cut short; under ignore_eos it goes on unconstrained after that EOS, as in vLLM). A matcher
that fails (a parser limit met) fails its request alone, with the reason.
"""

from __future__ import annotations

import numpy as np
import torch


class Grammar:
    """One request's matcher and how many of its output tokens it consumed. Kept by the sampler from the
    request's first sampled step to its end, so preemption (recomputing the same tokens) changes nothing."""

    def __init__(self, matcher, ignore_eos: bool = False):
        self.matcher = matcher
        self.ignore_eos = ignore_eos
        self.num_consumed = 0
        self.terminated = False  # EOS came after the grammar completed, and did not stop the request

    def advance(self, output_token_ids: list[int]) -> None:
        """Feed the tokens sampled since the last call. Under ignore_eos, the EOS after the grammar
        completed ends the constraint: the output goes on free, as in vLLM. Otherwise only EOS follows
        (min_tokens may make several), and is not fed."""
        for token_id in output_token_ids[self.num_consumed :]:
            if self.matcher.is_stopped():
                self.terminated = self.ignore_eos
                break
            self.matcher.consume_token(token_id)  # an error shows in `error` (the mask allows EOS alone)
        self.num_consumed = len(output_token_ids)

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a parser limit met at this output: a grammar too wide for llguidance's
        limits, say), or None. Its mask then holds EOS alone, which would end the output as if complete."""
        return self.matcher.get_error() if self.matcher.is_error() else None


def banned(grammars: list[Grammar], vocab_size: int, num_logits: int, executor=None) -> torch.Tensor:
    """bool [len(grammars), num_logits]: True where a grammar bans the token next (vocab_size: the
    compiler's, >= num_logits; a terminated grammar bans nothing). With an llguidance LLExecutor, the
    rows' masks are computed on its threads, the GIL released."""
    import llguidance.torch as llg_torch

    width = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), width), -1, dtype=torch.int32)
    live = [(g.matcher, i) for i, g in enumerate(grammars) if not g.terminated]
    if executor is not None and len(live) > 1:
        llg_torch.fill_next_token_bitmask_par(executor, live, bitmask)
    else:
        for matcher, i in live:
            llg_torch.fill_next_token_bitmask(matcher, bitmask, i)
    # a set bit allows its token: the complement's bits are the bans, one pass over the words
    bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :num_logits]
    return torch.from_numpy(bits).view(torch.bool)
