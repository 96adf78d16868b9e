"""Draft-model proposals for speculative decoding: a small model of the target's vocabulary guesses the
next K tokens of each decoding request, greedily, and the target verifies them (rejection_sampler.py).

The draft has a paged KV cache of its own, with a pool of its own (a free list here: the target's block
manager never sees it). Each request's draft state is the list of tokens whose keys and values the draft
holds, in order from position 0:

    [ real tokens: a prefix of the request's sequence ][ d1 .. d(K-1): the draft's own last proposals ]

After the target verified them, the draft's cache is right up to where that list and the request's
sequence first differ; lowering the list's length there is the whole rollback (the slots past it are
overwritten by the next feed). A step then feeds, in one draft forward for every request, each one's
tokens from that point: prompt chunks as the target prefills them (so the draft's prefill runs
alongside the target's), and a decoding request's accepted proposals and its new token; K - 1 more
forwards of one token per request give the rest of the proposals.

A draft pays off only if its forward costs a fraction of the target's, and a small model's forward is
mostly the Python between its ops: the draft's forwards of one token per request (the proposals after
the first, and a feed of one new token) replay decode graphs (decode_graph.py) as the target's decode
steps do, each batch size captured at first sight (or by the server's warm-up). `--enforce-eager`
turns them off.

Greedy proposals are a deterministic guess, as an n-gram's is: the rejection sampler's one-hot draft
distribution holds for them, and the target's distribution is kept at every temperature.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infer.core.outputs import ScheduledRequest, SchedulerOutput
from infer.runner.model_runner import ModelRunner
from infer.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0)


@dataclass
class DraftWant:
    """What the engine asks of the draft for one running request after a step.

    token_ids: the request's whole sequence (prompt and outputs); the list the request owns, read only.
    num_ready: the tokens of it the draft may compute: the target's computed ones while it prefills, all
        of them once it decodes.
    num_proposals: proposals it may take (0 while it prefills, or when it may not speculate; its room
        before max_tokens otherwise): the draft proposes at most num_speculative_tokens of them.
    """

    req_id: str
    token_ids: list[int]
    num_ready: int
    num_proposals: int


@dataclass
class _DraftState:
    token_ids: list[int] = field(default_factory=list)  # whose KV the draft's cache holds, from position 0
    num_real: int = 0  # the first num_real of them are the request's own tokens; the rest are proposals
    block_ids: list[int] = field(default_factory=list)


class DraftProposer:
    """The draft model, its KV cache and pool, and each request's state in it.

    max_feed_tokens bounds the tokens of one catch-up forward (the target's step budget): a request
    that cannot catch up within it this step proposes nothing and catches up further next step.
    decode_graphs_max_len: the longest sequence a decode graph serves (None: every forward eager).
    propose_s counts the seconds spent proposing, for the benchmarks.
    """

    def __init__(
        self,
        model,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        max_feed_tokens: int,
        kv_cache_dtype: torch.dtype | None = None,
        decode_graphs_max_len: int | None = None,
    ):
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_feed_tokens = max_feed_tokens
        self.runner = ModelRunner(
            model,
            num_blocks,
            block_size,
            kv_cache_dtype=kv_cache_dtype,
            decode_graphs_max_len=decode_graphs_max_len,
            decode_graphs_steady_steps=1,
        )
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, ...
        self.states: dict[str, _DraftState] = {}
        self.propose_s = 0.0

    def warm_up(self, max_batch_size: int) -> None:
        """Capture the decode graphs of batch sizes 1..max_batch_size now (the pool must be fresh: no
        request has run)."""
        if self.runner.graphs is not None:
            self.runner.graphs.warm_up(range(1, min(max_batch_size, self.num_blocks) + 1))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def check_integrity(self) -> None:
        """Every block either free or held by exactly one request; each request holds enough for its
        tokens."""
        held = [b for s in self.states.values() for b in s.block_ids]
        assert len(held) == len(set(held)), "a draft block held twice"
        assert sorted(held + self.free_block_ids) == list(range(self.num_blocks)), "draft blocks lost"
        for state in self.states.values():
            assert len(state.block_ids) * self.block_size >= len(state.token_ids)

    def retain(self, req_ids) -> None:
        """Free the state of every request not among req_ids (finished, aborted or preempted)."""
        keep = set(req_ids)
        self.forget([req_id for req_id in self.states if req_id not in keep])

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.free_block_ids.extend(reversed(state.block_ids))

    @torch.inference_mode()
    def propose(self, wants: list[DraftWant]) -> dict[str, list[int]]:
        """Catch the draft up on every request and propose for those that want proposals; req_id ->
        proposals (only requests that got some)."""
        start = time.perf_counter()
        try:
            return self._propose(wants)
        finally:
            self.propose_s += time.perf_counter() - start

    def _propose(self, wants: list[DraftWant]) -> dict[str, list[int]]:
        feeds = self._plan_feeds(wants)
        if not feeds:
            return {}
        scheduled = [
            ScheduledRequest(
                req_id=w.req_id,
                token_ids=tokens,
                start_pos=start,
                block_ids=list(self.states[w.req_id].block_ids),
                sample=w.num_proposals > 0,
                sampling_params=_GREEDY,
                num_prompt_tokens=0,
            )
            for w, start, tokens in feeds
        ]
        for w, start, tokens in feeds:
            state = self.states[w.req_id]
            del state.token_ids[start:]
            state.token_ids.extend(tokens)
            state.num_real = len(state.token_ids)
        proposing = [(w, s) for (w, _, _), s in zip(feeds, scheduled, strict=True) if w.num_proposals > 0]
        proposals: dict[str, list[int]] = {w.req_id: [] for w, _ in proposing}
        logits, _ = self.runner.logits(SchedulerOutput(scheduled=scheduled))
        while proposing:
            next_ids = logits.argmax(dim=-1).tolist()
            going = []
            for (w, s), token_id in zip(proposing, next_ids, strict=True):
                proposals[w.req_id].append(token_id)
                if len(proposals[w.req_id]) < w.num_proposals:
                    state = self.states[w.req_id]
                    going.append((w, _one_token(s, state, token_id)))
                    state.token_ids.append(token_id)  # fed as a proposal: past num_real
            proposing = going
            if going:
                logits, _ = self.runner.logits(SchedulerOutput(scheduled=[s for _, s in going]))
        return proposals

    def _plan_feeds(self, wants: list[DraftWant]) -> list[tuple[DraftWant, int, list[int]]]:
        """(want, start position, tokens to feed) per request that has something to feed, its blocks
        allocated for the feed and its proposals; the state's list is cut back to what stays valid."""
        feeds, budget = [], self.max_feed_tokens
        for w in wants:
            w.num_proposals = min(w.num_proposals, self.k)
            state = self.states.setdefault(w.req_id, _DraftState())
            start = _valid_length(state, w.token_ids)
            if w.num_proposals > 0:
                start = min(start, w.num_ready - 1)  # the last token is fed again: its row proposes
            end = min(w.num_ready, start + budget)
            if end <= start or (w.num_proposals > 0 and end < w.num_ready):
                del state.token_ids[start:]
                state.num_real = min(state.num_real, start)
                continue
            # the proposals after the first are fed too, at end .. end + num_proposals - 2
            num_slots = end + max(w.num_proposals - 1, 0)
            if not self._grow(state, num_slots):
                self.forget([w.req_id])  # the pool is full: this request goes without the draft
                continue
            budget -= end - start
            feeds.append((w, start, list(w.token_ids[start:end])))
        return feeds

    def _grow(self, state: _DraftState, num_slots: int) -> bool:
        needed = -(-num_slots // self.block_size) - len(state.block_ids)
        if needed > len(self.free_block_ids):
            return False
        for _ in range(needed):
            state.block_ids.append(self.free_block_ids.pop())
        return True


def _valid_length(state: _DraftState, token_ids: list[int]) -> int:
    """How many of the state's tokens are the request's: its real ones (a prefix, by construction), then
    its proposals up to the first the request's sequence does not have there."""
    n = min(state.num_real, len(token_ids))
    limit = min(len(state.token_ids), len(token_ids))
    while n < limit and state.token_ids[n] == token_ids[n]:
        n += 1
    del state.token_ids[n:]
    state.num_real = n
    return n


def _one_token(prev: ScheduledRequest, state: _DraftState, token_id: int) -> ScheduledRequest:
    """The next one-token feed after `prev`: its proposal, at the position after prev's tokens."""
    return ScheduledRequest(
        req_id=prev.req_id,
        token_ids=[token_id],
        start_pos=prev.start_pos + prev.num_tokens,
        block_ids=state.block_ids,
        sample=True,
        sampling_params=_GREEDY,
        num_prompt_tokens=0,
    )
