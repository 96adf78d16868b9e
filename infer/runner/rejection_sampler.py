"""Verifying proposals: which of a request's K proposed tokens to keep, and the token that follows them.

A request that fed its last token and proposals d1..dK gets K + 1 rows of logits: row j is the model's
distribution for the token after d1..dj. Each row is adjusted as the plain sampler would adjust it at
that point of the sequence (min_tokens, logit_bias, allowed ids, bad words, penalties over the history
with d1..dj appended; then temperature, top-k, top-p, min-p), so that every feature holds per position.

  - temperature 0: d(j+1) is kept while it is row j's argmax; the first row whose argmax differs emits
    that argmax and ends the step; with all K kept, row K's argmax follows them. The output is exactly
    the greedy output without proposals.
  - otherwise, the standard rejection sampling (Leviathan et al. 2023; vLLM's rejection sampler) with a
    draft distribution q: keep d with probability min(1, p(d) / q(d)), else sample from max(0, p - q)
    renormalised. An n-gram's q is one-hot on d, so d is kept with probability p(d), and a rejection
    samples from p with d's mass removed. Either way each emitted token is distributed as p given what
    precedes it: P(emit x) = p(d) [x = d] + (1 - p(d)) p(x) [x != d] / (1 - p(d)) = p(x).

A grammar (structured outputs) bans at row j what it bans after d1..dj: its matcher consumes the
proposals one at a time for the rows' masks, and is rolled back after. A proposal the grammar does not
allow there (or one after the grammar stopped) ends the request's draft: the rows from there on are not
verified, and the token after the kept proposals is drawn from the grammar's row, which is what a
rejection of the banned proposal would draw (its probability there is 0). Requests that ask for
logprobs are never given proposals (the engine's choice): their entries stay one per step.
"""

from __future__ import annotations

import torch

from infer.core.outputs import ScheduledRequest
from infer.runner.sampler import Sampler, adjusted, argmax, check_grammar, inverse_transform
from infer.structured_outputs.matcher import Grammar, banned


def verify(
    sampler: Sampler, logits: torch.Tensor, reqs: list[ScheduledRequest], eos_token_ids: list[int]
) -> list[list[int]]:
    """logits: [sum(1 + K_i), vocab], each request's rows in order. Per request, the tokens it emits:
    its accepted proposals, then one sampled token."""
    params, histories = [], []
    for s in reqs:
        p = s.sampling_params
        for j in range(len(s.spec_token_ids) + 1):
            params.append(p)
            history = s.history + s.spec_token_ids[:j] if p.needs_history else None
            histories.append((history, s.num_prompt_tokens) if p.needs_history else None)
    _ban_early_stops(logits, reqs, eos_token_ids)
    drafts, bans = _grammar_drafts(sampler, reqs, logits.shape[1])
    if any(p.adjusts_logits for p in params):
        logits = adjusted(logits, params, histories, bans=bans)  # built per row from its history
    targets = argmax(logits).tolist() if any(p.greedy for p in params) else None
    probs = None
    if not all(p.greedy for p in params):
        probs = sampler._filtered_probs(logits.float(), params)
    out, row = [], 0
    for s, draft in zip(reqs, drafts, strict=True):
        if s.sampling_params.greedy:
            out.append(accept_greedy(draft, targets[row : row + len(draft) + 1]))
        else:
            gen = sampler.generator_of(s.req_id, s.sampling_params.seed)
            out.append(accept_sampled(draft, probs[row : row + len(draft) + 1], gen))
        row += len(s.spec_token_ids) + 1
    return out


def _grammar_drafts(sampler: Sampler, reqs: list[ScheduledRequest], num_logits: int):
    """Per request, the proposals to verify (a grammar's request: up to the first it does not allow),
    and the grammar bans of its rows (rows, bool [rows, num_logits]) or None."""
    drafts, rows, masks, row = [], [], [], 0
    for s in reqs:
        p = s.sampling_params
        grammar = None
        if p.structured_outputs is not None:
            grammar = sampler.grammar(s.req_id, p, s.history, s.num_prompt_tokens)
        if grammar is None or grammar.terminated:
            drafts.append(s.spec_token_ids)
        else:
            draft, row_bans = _allowed_prefix(
                grammar, s.spec_token_ids, sampler.compiler.vocab_size, num_logits
            )
            drafts.append(draft)
            rows += range(row, row + len(row_bans))
            masks += row_bans
        row += len(s.spec_token_ids) + 1
    return drafts, ((rows, torch.cat(masks)) if rows else None)


def _allowed_prefix(grammar: Grammar, draft: list[int], vocab_size: int, num_logits: int):
    """The proposals the grammar allows one after another, stopping at one it bans or once it stopped,
    and the bans of rows 0..len(kept) (each bool [1, num_logits]); the matcher is left where it was."""
    row_bans = [banned([grammar], vocab_size, num_logits)]
    check_grammar(grammar)
    kept = 0
    for token_id in draft:
        matcher = grammar.matcher
        if matcher.is_stopped() or row_bans[-1][0, token_id] or not matcher.consume_token(token_id):
            break
        kept += 1
        row_bans.append(banned([grammar], vocab_size, num_logits))
    if kept:
        grammar.matcher.rollback(kept)
    return draft[:kept], row_bans


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The proposals equal to the target's argmax, up to the first that is not, then the target's token
    there (targets: K + 1 argmaxes)."""
    for j, token_id in enumerate(draft):
        if token_id != targets[j]:
            return draft[:j] + [targets[j]]
    return draft + [targets[len(draft)]]


def accept_sampled(draft: list[int], probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """probs: [K + 1, vocab], the target's filtered distributions. Each proposal kept with its target
    probability; at the first rejection a token from the target without the proposal's mass; with all
    kept, one from the last row."""
    uniforms = torch.rand(len(draft), generator=gen).tolist()
    for j, token_id in enumerate(draft):
        if uniforms[j] < float(probs[j, token_id]):
            continue
        residual = probs[j].clone()
        residual[token_id] = 0.0
        return draft[:j] + [_draw(residual, gen)]
    return draft + [_draw(probs[len(draft)], gen)]


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """A token with probability proportional to weights (the sampler's draw: no need to normalise)."""
    return int(
        inverse_transform(weights.unsqueeze(0), torch.rand(1, 1, generator=gen, dtype=torch.float64))[0]
    )


def _ban_early_stops(logits: torch.Tensor, reqs: list[ScheduledRequest], eos_token_ids: list[int]) -> None:
    """min_tokens per row: before that many outputs exist, EOS and stop token ids cannot follow. Row j
    of a request follows its outputs so far and j proposals."""
    row = 0
    for s in reqs:
        p = s.sampling_params
        num_generated = s.start_pos + 1 - s.num_prompt_tokens  # outputs before row 0's token
        for j in range(len(s.spec_token_ids) + 1):
            if p.min_tokens and num_generated + j < p.min_tokens:
                logits[row + j, p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)] = float("-inf")
        row += len(s.spec_token_ids) + 1
