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

Requests with a grammar or that ask for logprobs are never given proposals (the engine's choice), so a
grammar's state and logprobs' entries stay one per step.
"""

from __future__ import annotations

import torch

from infer.core.outputs import ScheduledRequest
from infer.runner.sampler import Sampler, adjusted, argmax


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
    if any(p.adjusts_logits for p in params):
        logits = adjusted(logits, params, histories)  # built per row from its history: no state kept
    targets = argmax(logits).tolist() if any(p.greedy for p in params) else None
    probs = None
    if not all(p.greedy for p in params):
        probs = sampler._filtered_probs(logits.float(), params)
    out, row = [], 0
    for s in reqs:
        num_rows = len(s.spec_token_ids) + 1
        if s.sampling_params.greedy:
            out.append(accept_greedy(s.spec_token_ids, targets[row : row + num_rows]))
        else:
            gen = _generator(sampler, s)
            out.append(accept_sampled(s.spec_token_ids, probs[row : row + num_rows], gen))
        row += num_rows
    return out


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
    """A token with probability proportional to weights (the sampler's exponential race: no need to
    normalise)."""
    noise = torch.empty(weights.shape).exponential_(generator=gen)
    return int((weights / noise).argmax())


def _generator(sampler: Sampler, s: ScheduledRequest) -> torch.Generator:
    """The request's own generator under a seed (as the sampler keeps it), else the sampler's."""
    seed = s.sampling_params.seed
    if seed is None:
        return sampler.generator
    gen = sampler.request_generators.get(s.req_id)
    if gen is None:
        gen = sampler.request_generators[s.req_id] = torch.Generator().manual_seed(seed)
    return gen


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
