"""Batched sampling: one pass over the logits of every request of a step.

Each row has its own temperature, top-k, top-p, min-p and optional seed. Filters run on the whole
[num_reqs, vocab] tensor at once; the only per-request work is drawing the noise of seeded rows from their
own generator, which is what makes a seeded request's tokens independent of its batch, a request's
grammar (structured outputs: infer.structured_outputs) and its allowed ids, logit_bias and penalties
(`Adjustment`); both kept per request and applied to a float32 copy of the logits, only in a step that
has such a request.

Sampling is inverse transform sampling: one uniform u a row, and the first token whose cumulative
probability exceeds u x the row's total. A greedy row beside them is one-hot (top-k 1), so it draws its
argmax. One number a row, where the exponential race (argmax(p / E), E ~ Exp(1)) drew one a token of the
vocabulary, which cost more than the model's step at a hundred sampled rows (docs/optimizations.md,
"Sampling"); a seeded row's draw is one number of its own generator a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer import kernels
from infer.config import usable_cores
from infer.sampling_params import SamplingParams, Unsatisfiable
from infer.structured_outputs.compiler import GrammarCompiler
from infer.structured_outputs.matcher import Grammar, banned

MAX_TEMPERATURE = 1e4
# A repetition penalty near 0 divides a positive logit into float32's overflow; capped here, so that
# dividing by the smallest temperature (1e-5) stays finite too.
MAX_ADJUSTED_LOGIT = 1e30
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class SampleResult:
    token_ids: list[int]
    # per request: None, or (logprob of the sampled token, [(token_id, logprob)] of the top-N)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, seed: int = 0, grammars: GrammarCompiler | None = None):
        self.generator = torch.Generator().manual_seed(seed)  # for rows without their own seed
        self.request_generators: dict[str, torch.Generator] = {}
        self.adjustments: dict[str, Adjustment] = {}  # of requests with allowed ids, a bias or penalties
        self.compiler = grammars  # None: structured outputs are refused before they get here
        self.grammars: dict[str, Grammar] = {}  # of requests with structured outputs
        self.grammar_starts: dict[str, int] = {}  # output index where a deferred grammar starts (once found)
        self.grammar_scanned: dict[str, int] = {}  # output tokens a deferred grammar's search has seen
        self._executor = None  # llguidance's threads, for the masks of several grammars in one step

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.request_generators.pop(req_id, None)
            self.adjustments.pop(req_id, None)
            self.grammars.pop(req_id, None)
            self.grammar_starts.pop(req_id, None)
            self.grammar_scanned.pop(req_id, None)
            if self.compiler is not None:
                self.compiler.release(req_id)

    def _adjustment(self, req_id: str, p: SamplingParams) -> Adjustment | None:
        if not p.has_adjustment:
            return None
        state = self.adjustments.get(req_id)
        if state is None:
            state = self.adjustments[req_id] = Adjustment(p)
        return state

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        params: list[SamplingParams],
        histories: list[tuple[list[int], int] | None] | None = None,
    ) -> SampleResult:
        """logits: [num_reqs, vocab_size], float32 or the LM head's dtype (upcast where math needs it).
        histories: per row, (the request's tokens so far, its prompt's length) where its params
        `needs_history`; None elsewhere."""
        raw = logits
        if any(p.adjusts_logits for p in params):
            histories = histories or [None] * len(params)
            states = [self._adjustment(req_id, p) for req_id, p in zip(req_ids, params, strict=True)]
            bans = self._grammar_bans(req_ids, params, histories, logits.shape[1])
            logits = adjusted(logits, params, histories, states, bans)
        if all(p.greedy for p in params):
            token_ids = argmax(logits)
        else:
            probs = self._filtered_probs(logits.float(), params)
            token_ids = self._draw(probs, req_ids, params)
        return SampleResult(token_ids.tolist(), self._logprobs(raw, token_ids, params))

    def _grammar_bans(self, req_ids, params, histories, num_logits: int):
        """(rows, bool [len(rows), num_logits]) of the rows with a grammar: what each bans next."""
        rows, grammars = [], []
        for row, p in enumerate(params):
            if p.structured_outputs is None:
                continue
            grammar = self.grammar(req_ids[row], p, *histories[row])
            if grammar is None:  # the output is free until the ids that start the grammar
                continue
            rows.append(row)
            grammars.append(grammar)
        if not rows:
            return None
        if len(grammars) > 1 and self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=usable_cores())
        bans = banned(grammars, self.compiler.vocab_size, num_logits, self._executor)
        for grammar in grammars:
            check_grammar(grammar)
        return rows, bans

    def grammar(self, req_id: str, p: SamplingParams, history: list[int], num_prompt: int) -> Grammar | None:
        """The request's grammar, fed its output up to the end of history; None while a grammar that
        starts after grammar_after_ids has not started."""
        start = self._grammar_start(req_id, p.grammar_after_ids, history, num_prompt)
        if start is None:
            return None
        grammar = self.grammars.get(req_id)
        if grammar is None:
            matcher = self.compiler.take(req_id, p.structured_outputs)
            grammar = self.grammars[req_id] = Grammar(matcher, p.ignore_eos)
        grammar.advance(history[num_prompt + start :])
        return grammar

    def _grammar_start(self, req_id: str, after: tuple[int, ...], history: list[int], num_prompt: int):
        """Where in the output a request's grammar starts: 0, or just past the first appearance of
        `after` (None while it has not appeared). Each step scans only the tokens it added; once found,
        the start is kept (the output only grows)."""
        if not after:
            return 0
        start = self.grammar_starts.get(req_id)
        if start is not None:
            return start
        output = history[num_prompt:]
        first = max(0, self.grammar_scanned.get(req_id, 0) - len(after) + 1)
        for i in range(first, len(output) - len(after) + 1):
            if output[i] == after[0] and tuple(output[i : i + len(after)]) == after:
                start = self.grammar_starts[req_id] = i + len(after)
                return start
        self.grammar_scanned[req_id] = len(output)
        return None

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # Above ~1e4 the distribution is uniform to float32 precision; the cap keeps 1e300 from becoming
        # inf in float32, which would turn a banned token's -inf logit into NaN.
        temperature = torch.tensor([min(p.temperature, MAX_TEMPERATURE) or 1.0 for p in params])
        logits = logits / temperature.unsqueeze(1)
        greedy_rows = torch.tensor([p.greedy for p in params])
        top_k = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params])
        top_k = torch.where(greedy_rows, 1, top_k)  # greedy rows: keep only the argmax
        # Each filter reads only the rows that ask for it, and top-k only as wide as their largest k: a
        # greedy stream beside 128 sampled rows once sorted all of them every step (49,152 tokens: ~1 s
        # on one loaded core, where the greedy row's max takes 0.2 ms).
        rows = (top_k > 0).nonzero().squeeze(1)
        if rows.numel():
            some, k = logits[rows], top_k[rows].clamp(max=logits.shape[1])
            kth = some.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [len(rows), 1]
            logits = logits.index_copy(0, rows, some.masked_fill(some < kth, float("-inf")))
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in params])
        rows = (top_p < 1.0).nonzero().squeeze(1)
        if rows.numel():
            some = probs[rows]
            sorted_probs, order = some.sort(dim=-1, descending=True)
            # drop a token when the mass strictly before it already reaches top_p; the most likely token
            # always stays, also for a top_p that rounds to 0 in float32 (1e-300)
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[rows].unsqueeze(1)
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.index_copy(0, rows, some.masked_fill(drop, 0.0))
        min_p = torch.tensor([p.min_p for p in params])
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """A token a row, with probability proportional to the row's probs (module docstring)."""
        uniform = torch.rand(probs.shape[0], 1, generator=self.generator, dtype=torch.float64)
        for row, (req_id, p) in enumerate(zip(req_ids, params, strict=True)):
            if p.seed is not None:
                uniform[row] = torch.rand(1, generator=self.generator_of(req_id, p.seed), dtype=torch.float64)
        return inverse_transform(probs, uniform)

    def generator_of(self, req_id: str, seed: int | None) -> torch.Generator:
        """The request's own generator under a seed (kept until it finishes), else the sampler's."""
        if seed is None:
            return self.generator
        gen = self.request_generators.get(req_id)
        if gen is None:
            gen = self.request_generators[req_id] = torch.Generator().manual_seed(seed)
        return gen

    def _logprobs(self, logits, token_ids, params):
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # of the model's distribution, as vLLM reports
        top_n = max(n for n in wanted if n is not None)
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        out = []
        for row, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            top = list(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)) if n else []
            out.append((sampled[row], top))
        return out


def _bans(p: SamplingParams) -> bool:
    """Whether the row can lose every token: to a grammar, allowed ids, bad words or min_tokens."""
    return bool(p.min_tokens or p.allowed_token_ids is not None or p.bad_words_token_ids)


class Adjustment:
    """One request's allowed ids, bad words, bias and penalty state, built at its first sampled step and
    kept (Sampler.adjustments) until it finishes. Each later step folds in only the tokens its history
    gained, and the penalties touch only the tokens seen (prompt and output) or generated: O(those
    tokens), not O(vocabulary), per step (docs/structured-outputs.md, "Penalties and logit_bias")."""

    def __init__(self, p: SamplingParams):
        self.params = p
        self.allowed = None if p.allowed_token_ids is None else torch.tensor(p.allowed_token_ids)
        # logit_bias as tensors, built once: adjusted() adds every row's in one index_add_ per step
        self.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.int64) if p.logit_bias else None
        self.bias = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32) if p.logit_bias else None
        self.seen: set[int] | None = set() if p.repetition_penalty != 1.0 else None
        self.seen_ids: torch.Tensor | None = None  # the same ids as a tensor
        self.counts: dict[int, int] | None = {} if p.presence_penalty or p.frequency_penalty else None
        self.num_folded = 0  # tokens of the history already in seen / counts
        self.bad_words = p.bad_words_token_ids or []
        self.num_recent = max((len(ids) for ids in self.bad_words), default=1) - 1  # longest bad prefix
        self.recent: list[int] = []  # the output's last num_recent tokens

    def fold(self, history: list[int], num_prompt: int) -> None:
        new = history[self.num_folded :]
        if self.seen is not None and (fresh := [t for t in dict.fromkeys(new) if t not in self.seen]):
            self.seen.update(fresh)
            fresh_ids = torch.tensor(fresh)
            self.seen_ids = fresh_ids if self.seen_ids is None else torch.cat([self.seen_ids, fresh_ids])
        if self.counts is not None:
            for t in new[max(num_prompt - self.num_folded, 0) :]:
                self.counts[t] = self.counts.get(t, 0) + 1
        if self.num_recent:
            self.recent = history[max(num_prompt, len(history) - self.num_recent) :]
        self.num_folded = len(history)

    def apply(self, x: torch.Tensor) -> None:
        """In place on one float32 row, in vLLM's order and by its formulas (the repetition penalty is also
        transformers'): tokens outside allowed_token_ids banned; a bad word's last token banned where the
        output ends with the tokens before it (vLLM's: the output's, not the prompt's); logit_bias added;
        over the prompt and the output, a positive logit / repetition_penalty and a negative one * it;
        over the output, frequency_penalty x (times generated) + presence_penalty subtracted. A banned
        token's -inf stays -inf; every other value stays within +-MAX_ADJUSTED_LOGIT, so no penalty can
        turn a row into NaN or leave it with nothing to sample."""
        self.ban(x)
        if self.bias is not None:
            x.index_add_(0, self.bias_ids, self.bias)
        self.penalize(x)

    def ban(self, x: torch.Tensor) -> None:
        """apply()'s first part, before logit_bias: allowed_token_ids and bad words."""
        if self.allowed is not None:
            kept = x.index_select(0, self.allowed)
            x.fill_(float("-inf")).index_copy_(0, self.allowed, kept)
        recent = self.recent
        for ids in self.bad_words:
            prefix = len(ids) - 1
            if prefix == 0 or (prefix <= len(recent) and recent[len(recent) - prefix :] == ids[:-1]):
                x[ids[-1]] = float("-inf")

    def penalize(self, x: torch.Tensor) -> None:
        """apply()'s last part, after logit_bias: the repetition, frequency and presence penalties."""
        p = self.params
        if self.seen_ids is not None:
            penalty = min(p.repetition_penalty, FLOAT32_MAX)  # a float32 factor: 0 * it stays 0
            v = x.index_select(0, self.seen_ids)
            scaled = torch.where(v > 0, v / penalty, v * penalty).clamp_(
                -MAX_ADJUSTED_LOGIT, MAX_ADJUSTED_LOGIT
            )
            x.index_copy_(0, self.seen_ids, torch.where(v > float("-inf"), scaled, v))
        if self.counts:
            ids, counts = torch.tensor(list(self.counts)), torch.tensor(list(self.counts.values()))
            x.index_add_(0, ids, -(p.frequency_penalty * counts.float() + p.presence_penalty))


def check_grammar(grammar: Grammar) -> None:
    if grammar.error is not None:  # fails this request alone (the engine splits the step)
        raise Unsatisfiable(f"structured_outputs: the grammar's parser failed: {grammar.error}")


def adjusted(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], int] | None],
    states: list[Adjustment | None] | None = None,
    bans: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A float32 copy of the logits with each row's grammar bans (`bans`: rows, bool [rows, vocab]) and
    Adjustment applied (`states`: the requests' own, kept between steps; None: built here from the
    histories). A grammar is never broken: where the other bans (allowed ids, bad words, min_tokens)
    leave a row nothing, it samples among the grammar's tokens alone; without a grammar, such a row is
    Unsatisfiable (the engine ends that request alone)."""
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # flat: _add_biases
    if bans is not None:
        rows, banned_ids = bans
        if len(rows) == len(params):  # every row (one pass, no gather and scatter)
            out.masked_fill_(banned_ids, float("-inf"))
        else:
            out[rows] = out[rows].masked_fill_(banned_ids, float("-inf"))
    rows = {}
    for row, p in enumerate(params):
        if not p.has_adjustment:
            continue
        state = rows[row] = states[row] if states is not None else Adjustment(p)
        if p.needs_history:
            state.fold(*histories[row])
        state.ban(out[row])
    _add_biases(out, rows)
    for row, state in rows.items():
        state.penalize(out[row])
    grammar_rows = dict(zip(bans[0], range(len(bans[0])), strict=True)) if bans is not None else {}
    for row, p in enumerate(params):
        # only bans can empty a row (a logit_bias or a penalty stays finite)
        if not (_bans(p) and out[row].max() == float("-inf")):
            continue
        if row not in grammar_rows:
            raise Unsatisfiable(
                "allowed_token_ids, bad_words and min_tokens together leave no token to sample; "
                "allow more tokens"
            )
        grammar_bans = bans[1][grammar_rows[row]]
        out[row] = logits[row].float().masked_fill(grammar_bans, float("-inf"))  # the model's, in the grammar
        if out[row].max() == float("-inf"):  # min_tokens banned them there too (EOS): equal odds
            out[row] = torch.zeros(out.shape[1]).masked_fill_(grammar_bans, float("-inf"))
    return out


def _add_biases(out: torch.Tensor, states: dict[int, Adjustment]) -> None:
    """Every row's logit_bias in one index_add_ over the flat [num_reqs * vocab] logits (Adjustment.apply
    adds one row's alike): a step's cost does not grow with a Python call per biased row."""
    biased = [(row, state) for row, state in states.items() if state.bias is not None]
    if not biased:
        return
    vocab = out.shape[1]
    index = torch.cat([state.bias_ids + row * vocab for row, state in biased])
    values = torch.cat([state.bias for _, state in biased])
    out.view(-1).index_add_(0, index, values)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as torch's (the first of equal maxima): through the C++ op where it serves (a
    CPU float32/bfloat16/float16 matrix, rows contiguous), which reads bf16 logits as they are and costs
    ~36 us for 32 x 32000 where torch's float32 copy and argmax cost ~550 us (AMD EPYC, 2 threads)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in kernels.LAYER_OPS_DTYPES
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
        and (ops := kernels.load()) is not None
    ):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def inverse_transform(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token a row of weights [rows, vocab] (not normalised), with probability proportional to its
    weight, from uniform [rows, 1] (float64, in [0, 1)): the first token whose cumulative weight exceeds
    uniform x the row's total. "right": a token without weight (its sum equal to the one before) is never
    drawn."""
    cdf = weights.cumsum(dim=-1)
    ids = torch.searchsorted(cdf, (uniform * cdf[:, -1:].double()).to(cdf.dtype), right=True).squeeze(1)
    ids = ids.clamp(max=weights.shape[1] - 1)
    empty = weights.gather(1, ids.unsqueeze(1)).squeeze(1) == 0  # a draw rounded up to the total
    if bool(empty.any()):
        ids[empty] = weights.shape[1] - 1 - (weights[empty].flip(-1) > 0).int().argmax(dim=-1)
    return ids
