"""SchedulerOutput -> tensors -> one forward -> sampled tokens -> ModelRunnerOutput.

One forward per step over the flat batch of every scheduled token: decode tokens and prefill chunks
of different requests together. No Python loop runs per token: positions and slots are built from one
`range` per KV block touched, which costs less than the ~10 small tensor ops it replaced (a decode step
of a small model is dominated by such fixed costs: 138 -> ~40 us per step on the toy).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from infer import kernels
from infer.core.outputs import ModelRunnerOutput, SchedulerOutput, sampled_rows
from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.attention_metadata import StepInterrupted as StepInterrupted  # what `logits` raises
from infer.layers.parallel import SINGLE, TensorParallel
from infer.runner.decode_graph import STEADY_STEPS, DecodeGraphs
from infer.runner.kv_cache import allocate_kv_cache
from infer.runner.prompt_logprobs import PromptLogprobChunk
from infer.runner.rejection_sampler import verify
from infer.runner.sampler import Sampler
from infer.structured_outputs.compiler import GrammarCompiler

PROMPT_LOGPROBS_ROWS = 256  # [256, vocab] float32 logits at a time: 33 MB at 32,000 tokens


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    use_kv_cache=False is the no-cache mode of the KV-cache benchmark: every step recomputes each
    scheduled request's whole sequence (the runner keeps the token history itself). Under tensor
    parallelism (`tp`) every rank has a runner over its shard and runs `logits()`; rank 0 also samples
    (infer.runner.parallel).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        use_kv_cache: bool = True,
        eos_token_ids: frozenset[int] = frozenset(),
        tp: TensorParallel = SINGLE,
        kv_cache_dtype: torch.dtype | None = None,
        decode_graphs_max_len: int | None = None,
        grammars: GrammarCompiler | None = None,
        decode_graphs_steady_steps: int = STEADY_STEPS,
        num_speculative_tokens: int = 0,
    ):
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = block_size
        self.dtype = next(model.parameters()).dtype
        self.kv_cache_dtype = kv_cache_dtype or self.dtype  # fp8 under --kv-cache-dtype fp8
        self.kv_caches = (
            allocate_kv_cache(model.config, num_blocks, block_size, self.kv_cache_dtype, tp)
            if use_kv_cache
            else None
        )
        self.sampler = Sampler(seed, grammars)
        built = kernels.load() is not None  # now, not in the first step that needs it (a first build: ~10 s)
        # decode steps replayed from graphs (infer.runner.decode_graph): given the longest sequence, with a
        # KV cache, on one rank, and the C++ kernels to run; with speculative decoding (K proposals at
        # most), its verification steps too
        self.graphs = None
        if decode_graphs_max_len and self.kv_caches is not None and tp.size == 1 and built:
            max_blocks = -(-decode_graphs_max_len // block_size)
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size,
                max_blocks,
                self.dtype,
                decode_graphs_steady_steps,
                verify_len=1 + num_speculative_tokens,
                max_len=decode_graphs_max_len,
            )
        self.last_prepare_s = 0.0
        # set by the engine for a step it may stop (llm_engine.py, "Interrupted steps"): asked around each
        # layer's attention and between prompt-logprob parts, True raises StepInterrupted out of `logits`
        self.interrupted: Callable[[], bool] | None = None
        self.last_prompt_logprobs: dict | None = None  # of the last `logits` call
        self.history: dict[str, list[int]] = {}  # no-cache mode only: each request's tokens so far

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches or [])

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.sample(*self.logits(sched))

    @torch.inference_mode()
    def logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list]:
        """The forward of one step: logits of the requests that sample this step, and those requests (and
        `last_prompt_logprobs`, for `sample`)."""
        self.sampler.forget(sched.finished_req_ids)
        for req_id in sched.finished_req_ids:
            self.history.pop(req_id, None)
        self.last_prepare_s = 0.0
        self.last_prompt_logprobs = None
        if sched.is_empty:
            return None, []
        if (  # a step that may be interrupted runs eagerly: a graph's replay cannot stop halfway
            self.graphs is not None
            and self.interrupted is None
            and (replayed := self.graphs.logits(sched.scheduled)) is not None
        ):
            return replayed
        start = time.perf_counter()
        input_ids, positions, meta = self._prepare(sched)
        self.last_prepare_s = time.perf_counter() - start
        hidden = self.model(input_ids, positions, meta)  # [num_tokens, hidden_size]
        if any(s.prompt_logprobs for s in sched.scheduled):
            self.last_prompt_logprobs = self._prompt_logprobs(sched.scheduled, hidden, meta)
        sampled = [s for s in sched.scheduled if s.sample]
        if not sampled:
            return None, []
        rows = sampled_rows(sched.scheduled, list(itertools.accumulate(meta.query_lens)))
        logits = self.model.compute_logits(hidden[rows], float32=False)
        if self.graphs is not None:
            self.graphs.maybe_capture(sched.scheduled, logits)
        return logits, sampled

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, reqs: list) -> ModelRunnerOutput:
        if logits is None:
            return ModelRunnerOutput([], [], prompt_logprobs=self.last_prompt_logprobs)
        if any(s.spec_token_ids for s in reqs):
            return self._sample_verifying(logits, reqs)
        self._ban_early_stops(logits, reqs)
        req_ids = [s.req_id for s in reqs]
        histories = [(s.history, s.num_prompt_tokens) if s.history is not None else None for s in reqs]
        result = self.sampler(logits, req_ids, [s.sampling_params for s in reqs], histories)
        return ModelRunnerOutput(req_ids, result.token_ids, result.logprobs, self.last_prompt_logprobs)

    def _sample_verifying(self, logits: torch.Tensor, reqs: list) -> ModelRunnerOutput:
        """A step with proposals: logits has 1 + K rows for a request that verifies K proposals, one for
        the others. Those sample as usual; the proposals are verified (rejection_sampler)."""
        plain, plain_rows, spec, spec_rows, row = [], [], [], [], 0
        for s in reqs:
            num_rows = 1 + len(s.spec_token_ids)
            (spec if s.spec_token_ids else plain).append(s)
            (spec_rows if s.spec_token_ids else plain_rows).extend(range(row, row + num_rows))
            row += num_rows
        out = self.sample(logits[plain_rows], plain) if plain else ModelRunnerOutput([], [])
        verified = verify(self.sampler, logits[spec_rows], spec, self.eos_token_ids)
        logprobs = out.logprobs if out.logprobs is not None else [None] * len(out.req_ids)
        for s, tokens in zip(spec, verified, strict=True):
            out.req_ids.append(s.req_id)
            out.sampled_token_ids.append(tokens[-1])
            out.accepted_token_ids[s.req_id] = tokens[:-1]
            logprobs.append(None)  # requests that want logprobs are not given proposals
        out.logprobs = logprobs
        out.prompt_logprobs = self.last_prompt_logprobs
        return out

    def _prompt_logprobs(self, reqs, hidden: torch.Tensor, meta: AttentionMetadata) -> dict:
        """req_id -> PromptLogprobChunk: the rows this step computed at prompt positions p, p + 1, ...
        predict the prompt tokens at p + 1, ...; kept as tensors (prompt_logprobs.py: read where the
        response is written, not in the step). Logits are computed PROMPT_LOGPROBS_ROWS rows at a time,
        not [prompt, vocab] at once."""
        found, end = {}, 0
        for s, num_rows in zip(reqs, meta.query_lens, strict=True):
            row0, end = end, end + num_rows
            top_n = s.sampling_params.prompt_logprobs if s.prompt_logprobs else None
            pos0 = s.start_pos if self.kv_caches is not None else 0  # no-cache mode recomputes from 0
            first, last = s.start_pos, min(pos0 + num_rows, s.num_prompt_tokens - 1)
            if top_n is None or last <= first:
                continue
            rows = hidden[row0 + first - pos0 : row0 + last - pos0]
            targets = torch.tensor(s.history[first + 1 : last + 1])
            parts = []
            for i in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                meta.check_interrupted()
                part = targets[i : i + PROMPT_LOGPROBS_ROWS]
                logits = self.model.compute_logits(rows[i : i + len(part)])  # float32 [rows, vocab]
                norm = logsumexp_rows(logits)  # [rows, 1]; logprob = logit - norm
                chosen = logits.gather(1, part.unsqueeze(1))  # [rows, 1]
                ranks = (logits > chosen).sum(dim=-1, dtype=torch.int32) + 1  # int32: 4x a bool
                top_values, top_ids = logits.topk(top_n, dim=-1)
                parts.append(((chosen - norm).squeeze(1), ranks, top_ids, top_values - norm))
            logprobs, ranks, top_ids, top_values = (torch.cat(t) for t in zip(*parts, strict=True))
            found[s.req_id] = PromptLogprobChunk(first, targets, logprobs, ranks, top_ids, top_values)
        return found

    def _ban_early_stops(self, logits: torch.Tensor, reqs) -> None:
        """Before min_tokens outputs exist, EOS and stop token ids cannot be sampled (as in vLLM)."""
        for row, s in enumerate(reqs):
            p = s.sampling_params
            if p.min_tokens and s.start_pos + s.num_tokens - s.num_prompt_tokens < p.min_tokens:
                banned = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                logits[row, banned] = float("-inf")

    def _prepare(self, sched: SchedulerOutput):
        reqs = sched.scheduled
        if self.kv_caches is None:
            return self._prepare_no_cache(sched)
        token_ids = [t for s in reqs for t in s.token_ids]
        positions, slots = [], []
        bs = self.block_size
        for s in reqs:  # one Python iteration per block touched, not per token: cheaper than ~10 tensor ops
            pos, end = s.start_pos, s.start_pos + s.num_tokens
            positions.extend(range(pos, end))
            while pos < end:
                block, offset = divmod(pos, bs)
                num = min(bs - offset, end - pos)
                first_slot = s.block_ids[block] * bs + offset
                slots.extend(range(first_slot, first_slot + num))
                pos += num
        width = max(len(s.block_ids) for s in reqs)
        block_tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in reqs])
        meta = AttentionMetadata(
            query_lens=[s.num_tokens for s in reqs],
            seq_lens=[s.start_pos + s.num_tokens for s in reqs],
            slot_mapping=torch.tensor(slots),
            block_tables=block_tables,
            kv_caches=self.kv_caches,
            query_dtype=self.dtype,
            interrupted=self.interrupted,
        )
        return torch.tensor(token_ids), torch.tensor(positions), meta

    def _prepare_no_cache(self, sched: SchedulerOutput):
        sequences = []
        for s in sched.scheduled:
            history = self.history.setdefault(s.req_id, [])
            del history[s.start_pos :]  # a preempted request restarts from position 0
            history.extend(s.token_ids)
            sequences.append(history)
        input_ids = torch.tensor([t for seq in sequences for t in seq])
        positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
        meta = AttentionMetadata.prefill_only([len(seq) for seq in sequences])
        meta.interrupted = self.interrupted
        return input_ids, positions, meta


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dim, [rows, 1], without x86 exp's slow path for inputs below about
    -88, where its result underflows: logits that spread wide (a random model's) made torch's several
    times slower than the rest of a prompt-logprob chunk's logprob work. Terms below e^-80 of the largest
    are clamped to e^-80: at most vocab x 2e-35 of the sum."""
    top = logits.amax(dim=-1, keepdim=True)
    return top + (logits - top).clamp_(min=-80.0).exp_().sum(dim=-1, keepdim=True).log_()
