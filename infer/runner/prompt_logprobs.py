"""A prompt's logprobs (vLLM's prompt_logprobs) kept as the tensors the runner computed, turned into Python
objects only where they are read.

A 4,096-token prompt with a top 20 is ~86,000 (token, logprob) pairs: built as tuples in the step that
computed them, they held the engine thread (and the GIL) for a good share of that step, and every other
request's step waited. Here the step keeps five small tensors per chunk; the server reads the entries in
its own thread when it writes the response.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass
class PromptLogprobChunk:
    """One step's rows for one request: entries for the prompt positions first + 1, first + 2, ..."""

    first: int
    token_ids: torch.Tensor  # [n] the prompt tokens these rows predict
    logprobs: torch.Tensor  # [n] float32, their logprobs
    ranks: torch.Tensor  # [n] int32, their ranks in the row (1 = the likeliest)
    top_ids: torch.Tensor  # [n, top_n]
    top_logprobs: torch.Tensor  # [n, top_n] float32

    def __len__(self) -> int:
        return len(self.token_ids)

    def entries(self) -> list[tuple]:
        """(token id, logprob, rank, [(token id, logprob)] the top-N) per row."""
        tops = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(self.top_ids.tolist(), self.top_logprobs.tolist(), strict=True)
        ]
        columns = (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(), tops)
        return list(zip(*columns, strict=True))


class PromptLogprobs(Sequence):
    """Per prompt position: None for the first (and for a position never computed: a request aborted
    before its prompt was), else (token id, logprob, rank, [(token id, logprob)] top-N). Chunks come in
    the order they were computed; a position computed again (after a preemption) keeps its first value.
    Equal to a list of the same entries."""

    def __init__(self, num_prompt_tokens: int, chunks: list[PromptLogprobChunk]) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.chunks = chunks
        self._entries: list | None = None

    def _all(self) -> list:
        if self._entries is None:
            entries: list = [None] * self.num_prompt_tokens
            for chunk in self.chunks:
                for position, entry in enumerate(chunk.entries(), start=chunk.first + 1):
                    if position < self.num_prompt_tokens and entries[position] is None:
                        entries[position] = entry
            self._entries, self.chunks = entries, []
        return self._entries

    def __len__(self) -> int:
        return self.num_prompt_tokens

    def __getitem__(self, index):
        return self._all()[index]

    def __iter__(self) -> Iterator:
        return iter(self._all())

    def __eq__(self, other) -> bool:
        if isinstance(other, PromptLogprobs | list | tuple):
            return self._all() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"PromptLogprobs({self._all()!r})"
