"""Decode steps replayed from captured graphs: the forward without the Python between its ops.

A decode step of a small model spends ~30% of its time in the Python around its ~200 ops (module calls,
views, dispatch checks). In a step where every request decodes one token, what that Python does depends
on the batch size alone: the same ops on the same shapes, only the values differ (token ids, positions,
cache slots, block tables, context lengths). So once a batch size has held for STEADY_STEPS such steps,
`make_fx` records the forward, embedding to final hidden states, run on real tensors, as a flat graph
of the C++ kernels and torch ops (infer/kernels registers its ops per dispatch key so that a tracer
records each call as the op). The graph reads those values from static buffers that every later step
of that size refills, and the caches and weights by reference, as a CUDA graph does. TorchScript's C++
interpreter then runs that graph (`torch.jit.trace` of the FX module, which holds no Python to lose):
replayed as Python, one line per op, a step would still pay about half the cost it sets out to remove.
TorchScript is deprecated; a torch that cannot trace the graph replays the FX module.

The same holds for a step whose attention is the decode kernel's one batched call with short prompts or
chunks riding with the decodes (attention_metadata.batched_seqs), as a new request's first step beside
running streams is: its rows are tokens, and the kernel reads which rows belong to which sequence from
query_starts, a value like the others. So a decode graph is keyed by its rows, one per token, and holds
arguments for as many sequences: a step of fewer sequences leaves the rest without queries (seq_len 0),
which the kernel skips. The graph ends at the final hidden states; the LM head runs after the replay on
the rows that sample, as in the eager forward (its kernel's path depends on the row count).

A capture is kept only if its replay gives exactly the logits the eager forward gave for the step it was
captured on and it runs the C++ decode attention (whose Python does not look at the values); otherwise, or
if the capture raises, graphs stay off for the engine (logged). They also go off where they do not pay:
the first capture times replays against the eager forward (MIN_GAIN over PAYS_PAIRS pairs; a large
model's step is its weights' reads). Only with a KV cache on one rank (the runner decides).
`--enforce-eager` turns them off.

A capture takes a fraction of a second, once per batch size, at most MAX_GRAPHS; a server captures the
sizes up to max_num_seqs before it reports ready (`warm_up`), as many as fit in WARM_UP_SECONDS, because
a capture during a load stalls every stream of that step (up to a second for a 135M model on 2 cores,
where a replay saves ~1.5 ms a step). After a warm-up the sizes it did not reach run eagerly; without
one (the offline `LLM`) a size is captured once it has held, while MAX_GRAPHS and TABLES_MAX_BYTES
allow; past them a size stays eager. The sampler runs eagerly on the graph's logits, so every sampling
feature is unchanged. What graphs buy per model and batch, and what the warm-up costs:
docs/optimizations.md, "Decode graphs".

Speculative decoding's verification steps replay the same way: a step in which every request feeds its last
token and proposals (1 + K tokens at most, K = num_speculative_tokens) is keyed by (batch size, 1 + K), its
logits every row's. A request with fewer than K proposals (one at least) is padded to K with token 0 at the
positions that follow its own: the queries attend causally, so no real row sees a padding key, and a padding
key lands in a slot of the request's own table past its sequence, which no step reads before it writes it (a
block is hashed for the prefix cache only once its tokens are computed). A step whose padding would leave the
request's table (or the model's positions) runs eagerly, and so does a step in which some requests verify
proposals and others decode alone. A verification's queries (fewer than
attention_metadata.PREFILL_KERNEL_MIN_QUERY_LEN) take the decode kernel's batched call, as a decode's does, so
that each row is computed as a lone decode's would be; longer ones take the prefill kernel. Neither call's
Python reads a value, and padded or not its replay gives the eager logits. A batch size's streak counts the
steps either graph could replay, and a capture is checked against the eager logits of the step it is captured
on (a padded step's: the capture's own run of it, padded). Whether verification graphs pay is decided at their
first capture, apart from decode graphs'; a verification capture that fails turns verification graphs off, not
decode graphs."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import warnings
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from infer.core.outputs import ScheduledRequest, sampled_rows
from infer.layers import linear
from infer.layers.attention_metadata import AttentionMetadata, batched_seqs
from infer.sampling_params import SamplingParams

logger = logging.getLogger("infer.runner")
STEADY_STEPS = 4  # pure-decode steps of one batch size before it is captured: a passing size never is
MAX_GRAPHS = 128  # the default max_num_seqs: every batch size of a default server
# the server's captures before it is ready (llama-50m: 128 in 19 s); the rest once they hold
WARM_UP_SECONDS = 30
MIN_GAIN = 0.95  # a replay must take less than this share of the eager forward's time, or graphs go off
PAYS_PAIRS = 9  # eager forward / replay pairs timed to decide it (_check_pays)
TABLES_MAX_BYTES = 64 * 2**20  # all graphs' block tables (n x max_blocks int64): a long context's are large
# The warm-up captures every size up to EXACT_SIZES, then every PAD_STEP-th, then the rest while its time
# lasts: a step of a size not captured replays the next larger graph, its extra rows padding (up to
# linear.SMALL_ROWS rows, where every linear's rows run on the small-batch kernel, whose arithmetic per
# row does not depend on the row count from 2 rows on). A tile holds 16 rows: 9 rows padded to 16 cost
# about what 9 do.
EXACT_SIZES = 8
PAD_STEP = 8


@dataclass
class _Graph:
    module: torch.jit.ScriptModule | torch.fx.GraphModule | None
    # the static inputs: [n * width] each, tables [n, max_blocks], seq_lens [n]
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor  # int32, as the attention kernels take them
    starts: torch.Tensor | None  # int32 [n + 1]: each row's query start (decode graphs only)
    pads: bool = False  # the graph writes the cache with the C++ op, which skips padding's slots (-1)


class DecodeGraphs:
    """Graphs keyed by (batch size, tokens per request): 1 for decode steps, verify_len (1 + K) for
    speculative decoding's verification steps (1: none). steady_steps: steps of one such shape before it
    is captured. A draft model's one-token forwards come K - 1 at a time between multi-token ones, so a
    draft captures a size at first sight (1). max_len: the model's positions (a padding token's position
    stays below it)."""

    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        max_blocks: int,
        dtype: torch.dtype,
        steady_steps: int = STEADY_STEPS,
        verify_len: int = 1,
        max_len: int | None = None,
    ):
        self.model, self.kv_caches, self.dtype = model, kv_caches, dtype
        self.steady_steps = steady_steps
        self.block_size, self.max_blocks = block_size, max_blocks
        self.verify_len = verify_len
        self.max_len = max_len if max_len is not None else max_blocks * block_size
        self.graphs: dict[int, _Graph] = {}  # decode steps' graphs by batch size
        self.verify_graphs: dict[int, _Graph] = {}  # verification steps' (width verify_len) by batch size
        self.size = self.width = self.streak = 0  # the last replayable step's shape; steps of its size
        self.enabled = True
        self.verify_enabled = verify_len > 1
        self.captures = self.replays = 0
        # a capture stalls every stream of its step for a fraction of a second: after a warm-up (a
        # server's), the sizes it did not reach run eagerly instead of stalling a load
        self.capture_under_load = True
        self.verify_replays = 0  # of replays, those of verification steps
        self.pays: bool | None = None  # decided at the first capture (_check_pays)
        self.verify_pays: bool | None = None  # likewise, at the first verification capture
        self.interpret = True  # replay through TorchScript (_interpreted)

    def logits(self, reqs: list[ScheduledRequest]) -> tuple[torch.Tensor | None, list] | None:
        """The step's logits from its shape's graph, and the requests they sample for (a verifying
        request's 1 + k rows, one for another); None: run the forward eagerly (and then `maybe_capture`).
        The LM head runs after the replay, on the rows that sample, as in the eager forward."""
        width = self._width(reqs)
        if width is None:
            self.streak = 0
            return None
        size = _size(reqs, width)
        self.streak = self.streak + 1 if size == self.size and width == self.width else 1
        self.size, self.width = size, width
        graph = self._graphs(width).get(size) or (self._padded(size) if width == 1 else None)
        if graph is None or not self._fill(graph, reqs, width):
            return None
        self.replays += 1
        self.verify_replays += width > 1
        hidden = graph.module()
        sampled = [s for s in reqs if s.sample]
        if not sampled:
            return None, []
        return self.model.compute_logits(hidden[_sampled_rows(reqs, width)], float32=False), sampled

    def _padded(self, size: int) -> _Graph | None:
        """The smallest decode graph of more rows than size that may replay a step of size rows padded,
        or None."""
        if size < 2 or size > linear.SMALL_ROWS:
            return None
        larger = [n for n in self.graphs if size < n <= linear.SMALL_ROWS and self.graphs[n].pads]
        return self.graphs[min(larger)] if larger else None

    def _width(self, reqs: list[ScheduledRequest]) -> int | None:
        """Tokens a request that the step's graph feeds: 1 for a step that the decode kernel's batched
        call serves whole (decodes, short chunks riding with them: attention_metadata.batched_seqs), a
        row per token; verify_len for a step in which every request verifies proposals (padded to K);
        None for any other step (a prompt, a long chunk, prompt logprobs, lone decodes beside
        proposals), or graphs off."""
        if not self.enabled or any(s.prompt_logprobs for s in reqs):
            return None
        if not any(s.spec_token_ids for s in reqs):
            query_lens = [s.num_tokens for s in reqs]
            seq_lens = [s.start_pos + s.num_tokens for s in reqs]
            whole = len(batched_seqs(query_lens, seq_lens, self.kv_caches[0][0], self.dtype)) == len(reqs)
            return 1 if whole else None
        if not all(s.sample and s.num_tokens == 1 + len(s.spec_token_ids) for s in reqs):
            return None
        if self.verify_enabled and all(1 < len(s.token_ids) <= self.verify_len for s in reqs):
            return self.verify_len
        return None

    def maybe_capture(self, reqs: list[ScheduledRequest], logits: torch.Tensor) -> None:
        """After an eager step: capture its shape if its batch size has held for STEADY_STEPS steps
        that a graph could replay (decoding or verifying), checked against `logits`, the eager
        forward's; a padded verification step against the capture's own run of it, padded (the eager
        forward's logits of the unpadded step need not be the padded one's bit for bit)."""
        size, width = self.size, self.width
        if (
            not self.capture_under_load
            or (width == 1 and any(s.num_tokens != 1 for s in reqs))  # captured on decode steps alone
            or self.streak < self.steady_steps
            or size != _size(reqs, width)
            or size in self._graphs(width)
        ):
            return
        unpadded = width == 1 or all(len(s.token_ids) == width for s in reqs)
        self._capture(reqs, width, logits if unpadded else None)

    def warm_up(self, sizes, verify_sizes=()) -> None:
        """Capture these batch sizes now, on made-up decode steps (and verify_sizes on made-up
        verification steps), so that no step of a real load stalls on a capture (the server does this
        before it reports ready). Row i feeds token 0 at positions 0, 1, ... of block i: the pool is
        fresh, those blocks hold nothing yet, and a request writes its slots before it reads them."""
        start = time.perf_counter()
        num_blocks = self.kv_caches[0][0].shape[0]
        sizes = sorted(sizes)
        top = sizes[-1] if sizes else 0
        ladder = [n for n in sizes if n <= EXACT_SIZES or n % PAD_STEP == 0 or n == top]
        order = {n: i for i, n in enumerate(ladder + [n for n in sizes if n not in set(ladder)])}
        shapes = [(n, 1) for n in sizes]
        if self.verify_len <= self.block_size:  # each batch size's verification after its decode
            shapes += [(n, self.verify_len) for n in verify_sizes]
        shapes.sort(key=lambda shape: (order.get(shape[0], shape[0]), shape[1]))
        greedy = SamplingParams(temperature=0)
        for n, width in shapes:
            if not self.enabled:
                break
            if n <= num_blocks and n not in self._graphs(width) and (width == 1 or self.verify_enabled):
                spec = [0] * (width - 1)
                rows = [
                    ScheduledRequest(f"warm-up-{i}", [0] * width, 0, [i], True, greedy, 1, None, False, spec)
                    for i in range(n)
                ]
                self._capture(rows, width)
            if time.perf_counter() - start > WARM_UP_SECONDS and (n, width) != shapes[-1]:
                logger.info("decode graphs: warm-up out of time after size %d (width %d); the sizes not "
                            "captured replay a larger graph, padded, or run eagerly", n, width)  # fmt: skip
                break
        self.capture_under_load = False
        logger.info(
            "decode graphs: %d batch sizes captured (%d verifying) in %.1f s",
            len(self.graphs) + len(self.verify_graphs),
            len(self.verify_graphs),
            time.perf_counter() - start,
        )

    def _capture(self, reqs: list[ScheduledRequest], width: int, logits: torch.Tensor | None = None) -> None:
        """Capture the step's shape (_size, width), checked against `logits`, the eager forward's of the
        rows that sample (None: those of the traced run, the eager forward)."""
        n = _size(reqs, width)  # sequences a graph has room for: a row each for a decode graph
        held = [*self.graphs.values(), *self.verify_graphs.values()]
        tables = sum(g.tables.nbytes for g in held) + n * self.max_blocks * 8
        if len(held) >= MAX_GRAPHS or tables > TABLES_MAX_BYTES:
            return
        starts = torch.zeros(n + 1, dtype=torch.int32) if width == 1 else None
        graph = _Graph(None, *(torch.zeros(n * width, dtype=torch.long) for _ in range(3)),
                       torch.zeros(n, self.max_blocks, dtype=torch.long),
                       torch.zeros(n, dtype=torch.int32), starts)  # fmt: skip
        if not self._fill(graph, reqs, width):
            return
        static = (graph.slots, graph.tables, graph.seq_lens)
        if width == 1:
            meta = AttentionMetadata.static_decode(*static, graph.starts, self.kv_caches, self.dtype)
        else:
            meta = AttentionMetadata.static_verify(*static, width, self.kv_caches, self.dtype)

        outputs = []

        def forward():
            outputs.append(self.model(graph.ids, graph.positions, meta))
            return outputs[-1]

        try:  # the capture runs the forward once more: the same keys and values into the same slots
            with torch.inference_mode():  # as the runner's forward runs (layer ops are off under autograd)
                with _one_fake_mode():
                    traced = make_fx(forward)()
                rows = _sampled_rows(reqs, width)
                if logits is None:  # make_fx ran every op for real: its logits are the eager forward's
                    logits = self.model.compute_logits(outputs[-1][rows], float32=False)
                graph.module = self._interpreted(traced)
                replayed = self.model.compute_logits(graph.module()[rows], float32=False)
        except Exception as exc:  # an op the tracer cannot take: this model stays eager
            self._disable(f"capture failed: {type(exc).__name__}: {exc}", width)
            return
        targets = [str(node.target) for node in traced.graph.nodes if node.op == "call_function"]
        # the kernels' Python reads no value of the step: a graph of another attention path would keep
        # the masks and lengths of the step it was captured on
        kernel = "paged_attention" if meta.batch_seqs else "prefill_attention"
        if not any(kernel in t for t in targets):
            self._disable(f"the step does not run the C++ {kernel}", width)
        elif not torch.equal(replayed, logits):
            self._disable("the replay differs from the eager forward", width)
        elif (self.pays if width == 1 else self.verify_pays) is None and not self._check_pays(
            forward, graph.module, width
        ):
            return
        else:
            if isinstance(graph.module, torch.jit.ScriptModule):
                # TorchScript's executor profiles a graph's first run and optimizes it on the second
                # (~50 ms for a 135M model): here, and not on the first step of this size under load
                with torch.inference_mode():
                    graph.module()
            graph.pads = any("write_cache" in t for t in targets)
            self._graphs(width)[n] = graph
            self.captures += 1

    def _interpreted(self, traced: torch.fx.GraphModule):
        """`traced` run by TorchScript's C++ interpreter, or as it is if this torch cannot script it."""
        if self.interpret:
            try:
                with warnings.catch_warnings():  # TorchScript is deprecated; torch 2.13 still runs it
                    warnings.simplefilter("ignore", DeprecationWarning)
                    return torch.jit.trace(traced, (), check_trace=False)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                logger.warning("decode graphs replay in Python: TorchScript failed: %s", why)
                self.interpret = False
        return traced

    def _check_pays(self, forward, module, width: int = 1) -> bool:
        """At the first capture: whether a replay beats the eager forward by (1 - MIN_GAIN). A large
        model's step is its weights' reads, not the Python between its ops (Llama-3.2-1B replayed as
        Python: 91 against 93 ms), and then graphs cost their captures for nothing.

        Decided once for the engine's life, on PAYS_PAIRS eager forwards each followed by a replay, by two
        estimates that other work on the cores upsets differently: the fastest replay against the fastest
        forward, and the median of the pairs' ratios (a burst slows both of a pair alike). Graphs go off
        only when neither shows a gain: wrongly off, a small model's every step pays the Python a replay
        saves; wrongly on, a large model pays its captures once."""
        eager, replay = [], []
        with torch.inference_mode():
            module()  # TorchScript's executor profiles a graph's first runs and optimizes it after them
            for _ in range(PAYS_PAIRS):
                start = time.perf_counter()
                forward()
                eager.append(time.perf_counter() - start)
                start = time.perf_counter()
                module()
                replay.append(time.perf_counter() - start)
        ratios = sorted(r / max(e, 1e-9) for e, r in zip(eager, replay, strict=True))
        fastest, median = min(replay) / max(min(eager), 1e-9), ratios[len(ratios) // 2]
        pays = min(fastest, median) < MIN_GAIN
        if width == 1:
            self.pays = pays
        else:
            self.verify_pays = pays
        what = "a replay" if width == 1 else "a verification step's replay"
        how = (
            f"{what} takes {fastest:.2f}x the eager forward's time (fastest of {PAYS_PAIRS} each), "
            f"{median:.2f}x (median of their ratios)"
        )
        if not pays:
            self._disable(f"{how}: not worth capturing", width, logging.INFO)
        else:
            logger.info("decode graphs: %s", how)
        return pays

    def _fill(self, graph: _Graph, reqs: list[ScheduledRequest], width: int = 1) -> bool:
        """Refill the graph's inputs for this step: a decode graph's rows are the step's tokens, then as
        many padding rows as the graph has more; a verification graph's, each request's tokens padded
        to `width` (token 0 at the positions after its own). False where such a padding position is
        past the request's table or the model's positions (the step runs eagerly)."""
        bs = self.block_size
        num_blocks = max(len(s.block_ids) for s in reqs)
        if num_blocks > self.max_blocks:
            return False
        if width == 1:
            # a row per token, then padding rows (a larger graph's), which write no slot and are the
            # queries of one sequence of seq_len 0; the sequences past it have no queries
            size = graph.seq_lens.numel()
            extra = size - sum(s.num_tokens for s in reqs)
            ids = [t for s in reqs for t in s.token_ids]
            pos = [p for s in reqs for p in range(s.start_pos, s.start_pos + s.num_tokens)]
            per_row = [s for s in reqs for _ in range(s.num_tokens)]
            starts = [0, *itertools.accumulate(s.num_tokens for s in reqs)]
            starts += [size] * (size + 1 - len(starts))
            graph.starts.copy_(torch.tensor(starts, dtype=torch.int32))
            seq_lens = [s.start_pos + s.num_tokens for s in reqs] + [0] * (size - len(reqs))
        else:
            ends = [s.start_pos + width for s in reqs]
            if any(e > len(s.block_ids) * bs or e > self.max_len for s, e in zip(reqs, ends, strict=True)):
                return False
            ids = [t for s in reqs for t in s.token_ids + [0] * (width - len(s.token_ids))]
            pos = [p for s in reqs for p in range(s.start_pos, s.start_pos + width)]
            per_row = [s for s in reqs for _ in range(width)]
            seq_lens = [s.start_pos + width for s in reqs]
            extra = 0
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(per_row, pos, strict=True)]
        rows = torch.tensor([ids + [0] * extra, pos + [0] * extra, slots + [-1] * extra])
        graph.ids.copy_(rows[0])
        graph.positions.copy_(rows[1])
        graph.slots.copy_(rows[2])
        graph.seq_lens.copy_(torch.tensor(seq_lens))
        # entries past a sequence's own blocks are never read: the kernels read up to its seq_len
        table = [s.block_ids + [0] * (num_blocks - len(s.block_ids)) for s in reqs]
        graph.tables[: len(reqs), :num_blocks].copy_(torch.tensor(table))
        return True

    def _disable(self, why: str, width: int = 1, level: int = logging.WARNING) -> None:
        """Graphs off for the engine; a verification graph's failure (width > 1) turns off only
        verification graphs."""
        if width == 1:
            logger.log(level, "decode graphs off for this engine: %s", why)
            self.enabled = self.verify_enabled = False
            self.graphs.clear()
            self.verify_graphs.clear()
            return
        logger.log(level, "verification graphs off for this engine: %s", why)
        self.verify_enabled = False
        self.verify_graphs.clear()

    def _graphs(self, width: int) -> dict[int, _Graph]:
        return self.graphs if width == 1 else self.verify_graphs


def _size(reqs: list[ScheduledRequest], width: int) -> int:
    """A step's graph key: its rows (tokens) for a decode graph, its requests for a verification graph."""
    return sum(s.num_tokens for s in reqs) if width == 1 else len(reqs)


def _sampled_rows(reqs: list[ScheduledRequest], width: int) -> list[int]:
    """The graph's rows whose logits the step samples from, as the eager forward takes them: a decode
    graph's rows are the step's tokens, a verification graph's width per request, its padding last."""
    if width == 1:
        return sampled_rows(reqs, list(itertools.accumulate(s.num_tokens for s in reqs)))
    return sampled_rows(reqs, [i * width + s.num_tokens for i, s in enumerate(reqs)])


def _one_fake_mode():
    """A tracing context holding one FakeTensorMode for make_fx's node metadata, which otherwise builds
    a new mode (and extracts a stack trace) for every node: the same graph, captures ~1.5-2x faster.
    Private torch API: where it is missing, no context."""
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        return tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True)))
    except Exception:  # another torch's internals: slower captures, the same graphs
        return contextlib.nullcontext()
