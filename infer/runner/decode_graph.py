"""Decode steps replayed from captured graphs: the forward without the Python between its ops.

A decode step of a small model spends ~30% of its time in the Python around its ~200 ops (module calls,
views, dispatch checks). In a step where every request decodes one token, what that Python does depends
on the batch size alone: the same ops on the same shapes, only the values differ (token ids, positions,
cache slots, block tables, context lengths). So once a batch size has held for STEADY_STEPS such steps,
`make_fx` records the forward, embedding to logits, run on real tensors, as a flat graph of the C++
kernels and torch ops (infer/kernels registers its ops per dispatch key so that a tracer records each
call as the op). The graph reads those values from static buffers that every later step of that size
refills, and the caches and weights by reference, as a CUDA graph does. TorchScript's C++ interpreter
then runs that graph (`torch.jit.trace` of the FX module, which holds no Python to lose): replayed as
Python, one line per op, a step would still pay about half the cost it sets out to remove. TorchScript
is deprecated; a torch that cannot trace the graph replays the FX module.

A capture is kept only if its replay gives exactly the logits the eager forward gave for the step it was
captured on and it runs the C++ decode attention (whose Python does not look at the values); otherwise, or
if the capture raises, graphs stay off for the engine (logged). They also go off where they do not pay:
the first capture times replays against the eager forward (MIN_GAIN over PAYS_PAIRS pairs; a large
model's step is its weights' reads). Only with a KV cache on one rank (the runner decides).
`--enforce-eager` turns them off.

A capture takes a fraction of a second, once per batch size, at most MAX_GRAPHS; a server captures the
sizes up to max_num_seqs before it reports ready (`warm_up`), as many as fit in WARM_UP_SECONDS, because
a capture during a load stalls every stream of that step. A larger size is captured once it has held,
while MAX_GRAPHS and TABLES_MAX_BYTES allow; past them a size stays eager. The sampler runs eagerly on
the graph's logits, so every sampling feature is unchanged. What graphs buy per model and batch, and
what the warm-up costs: docs/optimizations.md, "Decode graphs"."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from infer.core.outputs import ScheduledRequest
from infer.layers.attention_metadata import AttentionMetadata
from infer.sampling_params import SamplingParams

logger = logging.getLogger("infer.runner")
STEADY_STEPS = 4  # pure-decode steps of one batch size before it is captured: a passing size never is
MAX_GRAPHS = 128  # the default max_num_seqs: every batch size of a default server
# the server's captures before it is ready (llama-50m: 128 in 19 s); the rest once they hold
WARM_UP_SECONDS = 30
MIN_GAIN = 0.95  # a replay must take less than this share of the eager forward's time, or graphs go off
PAYS_PAIRS = 9  # eager forward / replay pairs timed to decide it (_check_pays)
TABLES_MAX_BYTES = 64 * 2**20  # all graphs' block tables (n x max_blocks int64): a long context's are large


@dataclass
class _Graph:
    module: torch.jit.ScriptModule | torch.fx.GraphModule | None
    # the static inputs: [n] each, tables [n, max_blocks]
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor  # int32, as the attention kernel takes them


class DecodeGraphs:
    """steady_steps: pure-decode steps of one batch size before it is captured. A draft model's
    one-token forwards come K - 1 at a time between multi-token ones, so a draft captures a size at
    first sight (1)."""

    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        max_blocks: int,
        dtype: torch.dtype,
        steady_steps: int = STEADY_STEPS,
    ):
        self.model, self.kv_caches, self.dtype = model, kv_caches, dtype
        self.steady_steps = steady_steps
        self.block_size, self.max_blocks = block_size, max_blocks
        self.graphs: dict[int, _Graph] = {}
        self.size = self.streak = 0
        self.enabled = True
        self.captures = self.replays = 0
        self.pays: bool | None = None  # decided at the first capture (_check_pays)
        self.interpret = True  # replay through TorchScript (_interpreted)

    def logits(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """The step's logits from its batch size's graph; None: run the forward eagerly (and then
        `maybe_capture`)."""
        if not self.enabled or not all(len(s.token_ids) == 1 and s.sample for s in reqs):
            self.streak = 0
            return None
        self.streak = self.streak + 1 if len(reqs) == self.size else 1
        self.size = len(reqs)
        graph = self.graphs.get(len(reqs))
        if graph is None or not self._fill(graph, reqs):
            return None
        self.replays += 1
        return graph.module()

    def maybe_capture(self, reqs: list[ScheduledRequest], logits: torch.Tensor) -> None:
        """After an eager step: capture its batch size if it has held for STEADY_STEPS pure-decode
        steps, checked against `logits`, the eager forward's."""
        n = len(reqs)
        if self.streak >= self.steady_steps and n == self.size and n not in self.graphs:
            self._capture(reqs, logits)

    def warm_up(self, sizes) -> None:
        """Capture these batch sizes now, on made-up decode steps, so that no step of a real load stalls
        on a capture (the server does this before it reports ready). Row i decodes token 0 at position 0
        of block i: the pool is fresh, those blocks hold nothing yet, and a request writes its slots
        before it reads them."""
        start = time.perf_counter()
        num_blocks = self.kv_caches[0][0].shape[0]
        for n in sizes:
            if not self.enabled or n > num_blocks:
                break
            if n not in self.graphs:
                greedy = SamplingParams(temperature=0)
                rows = [ScheduledRequest(f"warm-up-{i}", [0], 0, [i], True, greedy, 1) for i in range(n)]
                self._capture(rows)
            if time.perf_counter() - start > WARM_UP_SECONDS and n != sizes[-1]:
                logger.info("decode graphs: warm-up out of time after size %d; larger ones are captured once "
                            "they hold", n)  # fmt: skip
                break
        logger.info(
            "decode graphs: %d batch sizes captured in %.1f s", len(self.graphs), time.perf_counter() - start
        )

    def _capture(self, reqs: list[ScheduledRequest], logits: torch.Tensor | None = None) -> None:
        """Capture len(reqs), checked against `logits` (None: those of the traced run, the eager forward)."""
        n = len(reqs)
        tables = sum(g.tables.nbytes for g in self.graphs.values()) + n * self.max_blocks * 8
        if len(self.graphs) >= MAX_GRAPHS or tables > TABLES_MAX_BYTES:
            return
        graph = _Graph(None, *(torch.zeros(n, dtype=torch.long) for _ in range(3)),
                       torch.zeros(n, self.max_blocks, dtype=torch.long),
                       torch.zeros(n, dtype=torch.int32))  # fmt: skip
        if not self._fill(graph, reqs):
            return
        static = (graph.slots, graph.tables, graph.seq_lens)
        meta = AttentionMetadata.static_decode(*static, self.kv_caches, self.dtype)

        outputs = []

        def forward():
            hidden = self.model(graph.ids, graph.positions, meta)
            outputs.append(self.model.compute_logits(hidden, float32=False))
            return outputs[-1]

        try:  # the capture runs the forward once more: the same keys and values into the same slots
            with torch.inference_mode():  # as the runner's forward runs (layer ops are off under autograd)
                with _one_fake_mode():
                    traced = make_fx(forward)()
                if logits is None:  # make_fx ran every op for real: its logits are the eager forward's
                    logits = outputs[-1]
                graph.module = self._interpreted(traced)
                replayed = graph.module()
        except Exception as exc:  # an op the tracer cannot take: this model stays eager
            self._disable(f"capture failed: {type(exc).__name__}: {exc}")
            return
        targets = [str(node.target) for node in traced.graph.nodes if node.op == "call_function"]
        if not any("paged_attention" in t for t in targets):
            self._disable("the step does not run the C++ decode attention")
        elif not torch.equal(replayed, logits):
            self._disable("the replay differs from the eager forward")
        elif self.pays is None and not self._check_pays(forward, graph.module):
            return
        else:
            self.graphs[n] = graph
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

    def _check_pays(self, forward, module) -> bool:
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
        self.pays = min(fastest, median) < MIN_GAIN
        how = (
            f"a replay takes {fastest:.2f}x the eager forward's time (fastest of {PAYS_PAIRS} each), "
            f"{median:.2f}x (median of their ratios)"
        )
        if not self.pays:
            self._disable(f"{how}: not worth capturing", logging.INFO)
        else:
            logger.info("decode graphs: %s", how)
        return self.pays

    def _fill(self, graph: _Graph, reqs: list[ScheduledRequest]) -> bool:
        bs = self.block_size
        width = max(len(s.block_ids) for s in reqs)
        if width > self.max_blocks:
            return False
        pos = [s.start_pos for s in reqs]
        rows = torch.tensor([
            [s.token_ids[0] for s in reqs],
            pos,
            [s.block_ids[p // bs] * bs + p % bs for s, p in zip(reqs, pos, strict=True)],
            [p + 1 for p in pos],
        ])  # fmt: skip
        graph.ids.copy_(rows[0])
        graph.positions.copy_(rows[1])
        graph.slots.copy_(rows[2])
        graph.seq_lens.copy_(rows[3])
        # entries past a sequence's own blocks are never read: the kernel reads up to its seq_len
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in reqs]
        graph.tables[:, :width].copy_(torch.tensor(table))
        return True

    def _disable(self, why: str, level: int = logging.WARNING) -> None:
        logger.log(level, "decode graphs off for this engine: %s", why)
        self.enabled = False
        self.graphs.clear()


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
