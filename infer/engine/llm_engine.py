"""The step loop: scheduler -> runner -> scheduler.update -> detokenize, one engine step at a time.

    engine = LLMEngine(EngineConfig())
    engine.add_request("In the beginning", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.text, end="")

`LLM` (infer.engine.llm) wraps this for offline batches; the server drives it from its own thread.

One request never fails another. Requests share a step, so an exception in the runner (a sampling value
that breaks the sampler, say) would end every request of the batch. Values are validated before a request
is queued, and as a second line of defence a step that raises is run again in halves, down to the single
requests that still fail; those end with finish_reason "error" and the rest of the step goes on. Running a
part again is safe: it writes the same tokens' keys and values to the same slots. It costs nothing until a
step fails, and log2(batch) extra forwards when one does. Detokenizing (stop strings) is per request too.

Interrupted steps. A step of long prefill chunks takes hundreds of milliseconds on a CPU, and so does a
step of a hundred decodes of one client's flood; a short request that arrives meanwhile would wait for its
end before its own prefill runs (which the scheduler then puts first, alone). Where the engine's owner says
when such a request arrives (`newcomer_waiting`, set by AsyncEngine), the step stops before or after a
layer's attention instead (half a layer's wait), and is forgotten (Scheduler.undo): nothing was sampled,
and its rows run again later over the same cache slots. A step may stop when it carries at least
INTERRUPTIBLE_TOKENS tokens or INTERRUPTIBLE_PREFILL_TOKENS of prefill (a prompt token costs a CPU what
several decodes do), no proposals to verify, and no decode but those of crowded groups (a client's flood,
a request's n choices: a lone stream's token is never delayed); it then runs eagerly, not from a decode
graph, which cannot stop halfway. A request's step is stopped only while its stopped steps, each
counted as at least its whole step (at the last whole long step's time per token), add up to at most
1 / INTERRUPT_EVERY of its time since it arrived: however many newcomers come, its stops cost it at most
one step and a 1 / INTERRUPT_EVERY share of the rest. By time, not by its own steps, so that a request
the scheduler held meanwhile (a prompt behind the streams) may stop again for the next newcomer. A
prompt's later chunks are shorter (scheduler.INTERRUPTED_CHUNK).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infer.config import EngineConfig
from infer.core.outputs import ModelRunnerOutput, SchedulerOutput, StepStats
from infer.core.request import Request, RequestStatus
from infer.core.scheduler import Scheduler
from infer.core.slo import Objectives, SloClasses
from infer.core.speculation_gate import SpeculationGate
from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.draft_model import draft_proposer
from infer.engine.tokenizer import load_tokenizer
from infer.engine.trace import StepTrace
from infer.layers.parallel import SINGLE
from infer.models.loader import load_engine_model, weight_bytes
from infer.runner.draft_proposer import DraftProposer, DraftWant
from infer.runner.kv_cache import auto_cache_dtype, kv_bytes_per_token, kv_cache_dtype, warn_unserved_fp8
from infer.runner.model_runner import ModelRunner, StepInterrupted
from infer.runner.ngram_proposer import NgramProposer
from infer.runner.parallel import ParallelRunner, RankFailure, run_worker, start_ranks, stop_ranks
from infer.runner.prompt_logprobs import PromptLogprobChunk, PromptLogprobs
from infer.sampling_params import MAX_BAD_WORDS, SamplingParams, Unsatisfiable
from infer.structured_outputs.compiler import GrammarCompiler

logger = logging.getLogger("infer.engine")
# a step may be interrupted for a newcomer from this many tokens, or this many of prefill (module docstring)
INTERRUPTIBLE_TOKENS = 128
# a newcomer that waits for a step whose prompt tokens add half a step's time has its first token up
# to 1.5x as late: a few prompt tokens are worth stopping for (docs/robustness.md)
INTERRUPTIBLE_PREFILL_TOKENS = 8
INTERRUPT_EVERY = 4  # a request's stopped steps lose at most 1 / this of its time in the engine (and one)
LONG_STEP_PRIOR_S = 0.1  # a step of INTERRUPTIBLE_TOKENS, before any long step ran whole
# the steps whose time per token prices a stopped step: this many prompt tokens, or INTERRUPTIBLE_TOKENS
# in all (a shorter step's time is mostly its weights' read, which would price a long one too high)
LONG_STEP_PREFILL_TOKENS = 32


def _carries(stats: StepStats, prefill_tokens: int) -> bool:
    """Whether a step carries `prefill_tokens` prompt tokens or INTERRUPTIBLE_TOKENS in all: with
    INTERRUPTIBLE_PREFILL_TOKENS, worth stopping for a newcomer; with LONG_STEP_PREFILL_TOKENS, long
    enough for its time per token to price a stopped step (module docstring)."""
    total = stats.num_prefill_tokens + stats.num_decode_tokens
    return stats.num_prefill_tokens >= prefill_tokens or total >= INTERRUPTIBLE_TOKENS


@dataclass
class StepOutput:
    """What one request gained in one step (or its end)."""

    req_id: str
    text: str  # new text, stop strings cut
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, counting the token that completed a stop string
    num_cached_tokens: int
    logprobs: Any = None  # (sampled token's logprob, [(token_id, logprob)] top-N) when asked for
    # with the request's first tokens (or its end), when asked for: per prompt token, None for the first,
    # then (token id, logprob, rank, [(token id, logprob)] top-N): a sequence read lazily
    prompt_logprobs: PromptLogprobs | None = None
    # the finished Request (timestamps, preemptions, prefill tokens computed), on the last output only
    request: Request | None = None
    error: str | None = None  # with finish_reason "error": what failed (for logs, not for clients)


@dataclass
class StepTiming:
    """Where one step's wall time went: bookkeeping (schedule, prepare, update) versus the model."""

    schedule_s: float = 0.0  # Scheduler.schedule()
    prepare_s: float = 0.0  # building the batch tensors
    forward_s: float = 0.0  # forward, logits and sampling
    update_s: float = 0.0  # Scheduler.update(): tokens appended, finishes, blocks freed and cached
    detokenize_s: float = 0.0  # incremental detokenization and stop strings

    @property
    def bookkeeping_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.update_s + self.detokenize_s


def run_tensor_parallel_worker(config: EngineConfig) -> int:
    """A launcher's rank > 0 (RANK set): serve rank 0's steps with this rank's shard; the exit code."""
    return run_worker(config)


def prompt_logprob_token_cost(model, model_config) -> float:
    """A prompt token whose logprobs are computed, in the cost of a plain one: its row of the LM head and
    a pass over its vocabulary's logits (log-softmax, top-N) on top of the model's per-token work."""
    head = model_config.vocab_size * model_config.hidden_size
    # prepacked and quantized weights are buffers, not parameters: both count
    total = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers()))
    body = max(total - head, 1)  # the embedding's lookup costs nothing per token; a tied one is counted once
    return 1.0 + 2 * head / body


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        ranks, workers = start_ranks(config) if config.tensor_parallel_size > 1 else (None, [])
        try:
            self._build(config, ranks, workers)
        except BaseException:
            if ranks is not None:  # the other ranks wait for a broadcast that will not come
                stop_ranks(ranks, workers)
            raise

    def _build(self, config: EngineConfig, ranks, workers) -> None:
        tp = ranks.tp if ranks else SINGLE
        model, self.model_config, path = load_engine_model(config, tp)
        self.tokenizer = load_tokenizer(path, config.tokenizer)
        self.grammars = GrammarCompiler.from_config(config, self.tokenizer, self.model_config.vocab_size)
        self.max_model_len = min(config.max_model_len or 10**9, self.model_config.max_position_embeddings)
        model_dtype = next(model.parameters()).dtype
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, auto_cache_dtype(model))
        warn_unserved_fp8(self.kv_cache_dtype, model_dtype, self.model_config.head_dim)
        self.kv_bytes_per_token = kv_bytes_per_token(self.model_config, self.kv_cache_dtype, tp)  # per rank
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_memory_gb * 2**30) // (config.block_size * self.kv_bytes_per_token)
        )
        self.cache_config = config.cache_config(num_blocks)
        self.scheduler_config = config.scheduler_config(self.max_model_len)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.scheduler.prompt_logprob_token_cost = prompt_logprob_token_cost(model, self.model_config)
        self.slo_classes = SloClasses.from_file(config.slo_config) if config.slo_config else None
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            config.seed,
            config.use_kv_cache,
            self.tokenizer.eos_token_ids,
            tp,
            self.kv_cache_dtype,
            None if config.enforce_eager else self.max_model_len,
            self.grammars,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens
            if config.speculative_config is not None
            else 0,
        )
        if ranks is not None:
            ranks.broadcast(num_blocks)
            self.runner = ParallelRunner(self.runner, ranks, workers)
        self.quantization = {**model.quantization, "weight_mib": round(weight_bytes(model) / 2**20, 1)}
        if model.gguf is not None:  # what the GGUF file held
            self.quantization["gguf"] = model.gguf
        self.proposer = self._proposer(config, num_blocks)
        spec = config.speculative_config
        self.speculation_gate = (
            None if spec is None else SpeculationGate(spec.disable_by_batch_size, spec.disable_by_gain)
        )
        self._propose_s = 0.0  # the last _propose's time: part of the next step's cost
        # whether a short request arrived since the current step began (module docstring, "Interrupted
        # steps"); None: steps are never interrupted (an offline LLM's engine)
        self.newcomer_waiting: Callable[[], bool] | None = None
        self.num_interrupted_steps = 0
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.prompt_logprobs: dict[str, list[PromptLogprobChunk]] = {}  # req_id -> computed chunks
        self.last_stats = StepStats()
        self.last_timing = StepTiming()
        # (seconds, tokens) of the last long step (LONG_STEP_PREFILL_TOKENS) that ran to its end (before
        # one did, a guess)
        self._long_step = (LONG_STEP_PRIOR_S, INTERRUPTIBLE_TOKENS)
        self._ids = itertools.count()
        # the step trace (infer.engine.trace), None unless asked for: then one `is not None` per step
        budget = self.scheduler_config.max_num_batched_tokens
        self.trace = StepTrace(config.trace_steps, budget=budget) if config.trace_path else None

    def _proposer(self, config: EngineConfig, num_blocks: int) -> NgramProposer | DraftProposer | None:
        spec = config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return draft_proposer(self, num_blocks)

    def close(self) -> None:
        """Write the trace file, if tracing (at shutdown; again whenever called). The engine stays usable."""
        if self.trace is not None:
            self.trace.write(self.config.trace_path)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any; the engine cannot step afterwards."""
        if isinstance(self.runner, ParallelRunner):
            self.runner.shutdown()

    @property
    def fatal_error(self) -> RankFailure | None:
        """Set when the engine cannot go on (a tensor-parallel rank died): its owner must stop."""
        return getattr(self.runner, "failure", None)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache_config.num_blocks * self.cache_config.block_size

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        priority: int = 0,
        slo: Objectives | None = None,
        matcher=None,
        group_id: str | None = None,
    ) -> Request:
        """Queue a request. ValueError (nothing queued) for bad token ids or one that can never fit.
        slo: its TTFT / TPOT objectives, which the "slo" scheduling policy serves; None: its class's in
        config.slo_config, if any. LateRequest (a ValueError) under slo_reject_late. matcher: its
        structured outputs' matcher, compiled off this thread (AsyncEngine.add); None: compiled here.
        group_id: shared by the engine requests of one API request (its n choices), or of one client (the
        server's API key), which the scheduler then admits in waves of a fair share of the batch and whose
        decodes beside other requests it bounds by the step's cost."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        if params.bad_words:
            params = dataclasses.replace(
                params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words)
            )
        bad_word_ids = [t for ids in params.bad_words_token_ids or () for t in ids]
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", bad_word_ids),
        ):
            bad = [t for t in ids or () if t >= vocab]
            if bad:  # a logit_bias id past the logits would fail the step of every request beside it
                raise ValueError(f"{name} token ids must be in [0, {vocab}) (the vocabulary); got {bad[:5]}")
        if params.allowed_token_ids is not None:  # bans that would leave nothing to sample, known now
            banned = {ids[0] for ids in params.bad_words_token_ids or () if len(ids) == 1}
            if params.min_tokens:
                banned |= set(params.stop_token_ids) | (
                    set() if params.ignore_eos else self.tokenizer.eos_token_ids
                )
            if banned.issuperset(params.allowed_token_ids):
                raise ValueError(
                    "allowed_token_ids holds only tokens that bad_words ban, or stop tokens, which "
                    "min_tokens bans until that many tokens exist; allow another token"
                )
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs are not served under tensor parallelism; leave them out")
        if params.structured_outputs is not None and matcher is None:  # an LLM's: its own thread
            matcher = self.grammars.matcher(params.structured_outputs)
        if slo is None and self.slo_classes is not None:
            slo = self.slo_classes.objectives_for(len(token_ids), params.max_tokens)
        req = Request(
            req_id=req_id if req_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=params,
            priority=priority,
            eos_token_ids=self.tokenizer.eos_token_ids,
            slo=slo,
            group_id=group_id,
        )
        self.scheduler.add_request(req)  # may refuse it (too long, late, an id in use): nothing kept yet
        if params.structured_outputs is not None:
            self.grammars.reserve(req.req_id, params.structured_outputs, matcher)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[req.req_id] = []
        self.requests[req.req_id] = req
        self.detokenizers[req.req_id] = IncrementalDetokenizer(
            self.tokenizer,
            token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str=params.include_stop_str_in_output,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        if self.trace is not None:
            self.trace.record_added(req.req_id, req.num_prompt_tokens, priority)
        return req

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as vLLM bans them: as written (at the start of the output), and after a
        space where that makes a word of as many tokens (in the middle of a sentence)."""
        sequences = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words {word!r} is no token of this tokenizer")
            sequences.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words make {len(sequences)} token sequences, more than {MAX_BAD_WORDS}")
        return sequences

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, req_ids: str | list[str]) -> list[StepOutput]:
        """End requests in any state; their blocks go back to the pool. Unknown ids are ignored."""
        ended = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        if isinstance(self.proposer, DraftProposer):
            self.proposer.forget(o.req_id for o in ended)
        outputs = [self._output(o.req_id, "", [], "abort", None) for o in ended]
        if self.trace is not None:
            self.trace.record_ended(outputs)
        return outputs

    def warm_up(self) -> None:
        """Ready a long-lived engine (a server or a replica does this before it reports ready): capture the
        decode graphs of batch sizes 1..max_num_seqs now (with speculative decoding, its verification
        steps' up to disable_by_batch_size after them), as many as fit in decode_graph.WARM_UP_SECONDS
        (none under enforce_eager and tensor parallelism), and a draft model's up to its
        disable_by_batch_size; build llguidance's tokenizer for grammars; then freeze the heap, as
        vLLM's engine core does: the ~300k objects alive after loading (imports, tokenizer, graphs) are
        out of the collector's reach, where a full collection of them stalled every stream at once
        (~150 ms on llama-50m; docs/optimizations.md, "The server around the engine")."""
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:  # and verification steps' at the batch sizes that speculate
            num_seqs = self.scheduler_config.max_num_seqs
            spec = self.config.speculative_config
            speculating = min(num_seqs, spec.disable_by_batch_size) if spec is not None else 0
            graphs.warm_up(range(1, num_seqs + 1), range(1, speculating + 1))
        if isinstance(self.proposer, DraftProposer):  # it runs while at most disable_by_batch_size do
            batch = self.config.speculative_config.disable_by_batch_size
            self.proposer.warm_up(min(self.scheduler_config.max_num_seqs, batch))
        self.grammars.warm_up()  # llguidance's tables here, not beside the streams of the first grammar
        gc.collect()
        gc.freeze()

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.last_stats = sched.stats
        scheduled = time.perf_counter()
        interruptible = self._interruptible(sched)
        if interruptible:
            self.runner.interrupted = self.newcomer_waiting
        try:
            runner_out, failures = self._execute(sched)
        except StepInterrupted:
            stopped = time.perf_counter() - scheduled
            # a stop counted as its whole step (the last long step's time per token): steps stopped
            # early must not stop again and again
            seconds, tokens = self._long_step
            self.scheduler.undo(sched, max(stopped, seconds * sched.num_batched_tokens / tokens))
            logger.debug(
                "step of %d tokens interrupted after %.1f ms for a newcomer",
                sched.num_batched_tokens,
                1000 * stopped,
            )
            self.num_interrupted_steps += 1
            return []
        finally:
            if interruptible:
                self.runner.interrupted = None
        executed = time.perf_counter()
        if _carries(sched.stats, LONG_STEP_PREFILL_TOKENS):
            self._long_step = (executed - scheduled, sched.num_batched_tokens)
        for req_id, chunk in (runner_out.prompt_logprobs or {}).items():
            found = self.prompt_logprobs.get(req_id)
            if found is not None:  # a recomputed position keeps its first value (PromptLogprobs)
                found.append(chunk)
        outputs = [self._fail(req_id, exc) for req_id, exc in failures.items()]
        updates = self.scheduler.update(sched, runner_out)
        updated = time.perf_counter()
        outputs += self._detokenize_all(updates)
        if self.proposer is not None:
            self._observe_speculation(sched, runner_out, failures, time.perf_counter() - start)
            proposing = time.perf_counter()
            self._propose()
            self._propose_s = time.perf_counter() - proposing
        self.last_timing = StepTiming(
            schedule_s=scheduled - start,
            prepare_s=self.runner.last_prepare_s,
            forward_s=executed - scheduled - self.runner.last_prepare_s,
            update_s=updated - executed,
            detokenize_s=time.perf_counter() - updated,
        )
        if sched.num_batched_tokens:  # the "slo" policy learns what a step of N tokens costs
            self.scheduler.observe_step(sched.num_batched_tokens, time.perf_counter() - start)
        if self.trace is not None:
            self.trace.record_step(start, self.last_timing, sched, outputs)
        return outputs

    def _interruptible(self, sched: SchedulerOutput) -> bool:
        """Whether this step may stop for a newcomer (module docstring, "Interrupted steps")."""
        stats = sched.stats
        if (
            self.newcomer_waiting is None
            or not isinstance(self.runner, ModelRunner)
            or stats.num_spec_tokens
            or not _carries(stats, INTERRUPTIBLE_PREFILL_TOKENS)
        ):
            return False
        for s in sched.scheduled:
            req = self.requests[s.req_id]
            lone_decode = req.decodes_from(s.start_pos) and not self.scheduler.is_crowded(s.req_id)
            if lone_decode or not self._may_interrupt(req):
                return False
        return True

    def _may_interrupt(self, req: Request) -> bool:
        return req.seconds_lost <= (time.monotonic() - req.arrival_time) / INTERRUPT_EVERY

    def _observe_speculation(self, sched, runner_out, failures, seconds: float) -> None:
        """A decode-only step's cost (with the proposing for it) and tokens, for the speculation gate."""
        if failures or sched.stats.num_prefill_tokens or not sched.scheduled:
            return
        accepted = runner_out.accepted_token_ids
        tokens = sum(1 + len(accepted.get(s.req_id, ())) for s in sched.scheduled)
        verified = sched.stats.num_spec_tokens > 0
        self.speculation_gate.observe(len(sched.scheduled), verified, seconds + self._propose_s, tokens)

    def _propose(self) -> None:
        """Proposals for the next step's decodes, where the speculation gate says they pay (few enough
        requests run, and at their number verification steps measured worth their cost:
        infer/core/speculation_gate.py). None for a request that asks for logprobs (its entries are
        kept one token per step) or whose grammar starts after grammar_after_ids (the start may fall
        among the proposals)."""
        running = self.scheduler.running
        decoding = sum(not req.is_prefill for req in running)
        speculate = self.speculation_gate.speculate(len(running), decoding)
        wanted = []
        for req in running:
            p = req.sampling_params
            room = p.max_tokens - req.num_output_tokens - 1  # the sampled token comes on top
            plain = p.logprobs is None and not p.grammar_after_ids
            wanted.append(room if speculate and plain and room > 0 and not req.is_prefill else 0)
            req.spec_token_ids = []
        if isinstance(self.proposer, DraftProposer):
            self._propose_with_draft(running, wanted, speculate)
            return
        for req, room in zip(running, wanted, strict=True):
            if room:
                req.spec_token_ids = self.proposer.propose(req.token_ids, room)

    def _propose_with_draft(self, running: list[Request], wanted: list[int], speculate: bool) -> None:
        """One batch of draft forwards: prompt chunks the target computed this step, then proposals. With
        speculation off for the step, the draft waits (its cache stays right for what it holds)."""
        self.proposer.retain(req.req_id for req in running)
        if not speculate:
            return
        wants = [
            DraftWant(
                req.req_id,
                req.token_ids,
                req.num_computed_tokens if req.is_prefill else len(req.token_ids),
                room,
            )
            for req, room in zip(running, wanted, strict=True)
            if room or req.is_prefill
        ]
        proposals = self.proposer.propose(wants)
        for req in running:
            req.spec_token_ids = proposals.get(req.req_id, [])

    def _execute(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """The runner's output, and the requests whose part of the step raised (see the module docstring)."""
        try:
            return self.runner.execute(sched), {}
        except (RankFailure, StepInterrupted):
            raise  # no request's fault: the engine stops, or runs the step again later
        except Exception as exc:
            if len(sched.scheduled) == 1:
                return ModelRunnerOutput([], []), {sched.scheduled[0].req_id: exc}
        if isinstance(self.runner, ModelRunner):  # a part that ran would not run again: halves run whole
            self.runner.interrupted = None
        mid = len(sched.scheduled) // 2
        merged, failures = ModelRunnerOutput([], [], [], {}), {}
        for part in (sched.scheduled[:mid], sched.scheduled[mid:]):
            out, failed = self._execute(dataclasses.replace(sched, scheduled=part, finished_req_ids=[]))
            merged.req_ids += out.req_ids
            merged.sampled_token_ids += out.sampled_token_ids
            merged.logprobs += out.logprobs or [None] * len(out.req_ids)
            merged.prompt_logprobs.update(out.prompt_logprobs or {})
            merged.accepted_token_ids.update(out.accepted_token_ids)
            failures.update(failed)
        return merged, failures

    def _fail(self, req_id: str, exc: Exception) -> StepOutput:
        """End one request whose work raised; the others of its step go on."""
        if isinstance(exc, Unsatisfiable):  # the request's own parameters: no traceback to read
            logger.warning("request %s ended: %s", req_id, exc)
        else:
            logger.error("request %s failed and was ended", req_id, exc_info=exc)
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
        return self._output(req_id, "", [], "error", None, error=f"{type(exc).__name__}: {exc}")

    def _detokenize_all(self, updates) -> list[StepOutput]:
        outputs = []
        for out in updates:
            try:
                outputs.append(self._detokenize(out))
            except Exception as exc:
                outputs.append(self._fail(out.req_id, exc))
        return outputs

    def _detokenize(self, out) -> StepOutput:
        detok = self.detokenizers[out.req_id]
        ids = out.new_token_ids
        if isinstance(out.stop_reason, int) and not detok.include_stop_str:
            ids = ids[:-1]  # the stop token (EOS, stop_token_ids) ends the text, not in it (as vLLM)
        num_read = detok.num_output_tokens
        text = detok.update(ids)
        reason = out.finish_reason
        num_kept = detok.num_output_tokens - num_read  # up to the one that completed a stop string
        if detok.stopped and num_kept < len(out.new_token_ids):
            # a speculative step emitted tokens past the stop string (a stop token too): they never were
            self.requests[out.req_id].drop_output_tail(len(out.new_token_ids) - num_kept)
            out.new_token_ids = out.new_token_ids[:num_kept]
        if detok.stopped:  # a stop string: the engine's to find, not the core's
            if not out.finished:
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED, detok.stop_str)
            reason = "stop"  # also when it completed on the max_tokens-th token
        elif out.finished:
            text += detok.flush()  # text held back in case it began a stop string
        return self._output(out.req_id, text, out.new_token_ids, reason, out.logprobs)

    def _output(
        self, req_id: str, text: str, token_ids: list[int], reason: str | None, logprobs, error=None
    ) -> StepOutput:
        req = self.requests[req_id]
        prompt_logprobs = None
        if req_id in self.prompt_logprobs and (token_ids or reason is not None):  # once, when complete
            prompt_logprobs = PromptLogprobs(req.num_prompt_tokens, self.prompt_logprobs.pop(req_id))
        if reason is not None:
            del self.requests[req_id], self.detokenizers[req_id]
        return StepOutput(
            req_id=req_id,
            text=text,
            token_ids=list(token_ids),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            request=req if reason is not None else None,
            error=error,
        )
