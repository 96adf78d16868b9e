"""vLLM's bad_words: greedy outputs under them equal transformers' generate under the same rule (written
here as a LogitsProcessor) on the embedded model, in engine configurations that chunk, recompute or drop
the KV cache; the rule's edges (the output's tokens, not the prompt's; the last token only after its
prefix) on the sampler directly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor

from infer.engine.llm import LLM
from infer.models.loader import EMBEDDED_MODEL
from infer.runner.sampler import Sampler
from infer.sampling_params import SamplingParams
from tests.engine.test_engine import CONFIGS
from tests.grids import first_fast
from tests.models.tiny_models import greedy_with

PROMPTS = ["In the beginning God created", "And he said unto them,", "The LORD is my shepherd"]
# two tokens, then words of one; each also after a space (vLLM adds that form only where it has as many
# tokens: " shall" is one token, "shall" two, so {"shall"} would leave " shall" free, as in vLLM)
WORDS = ["the earth", "unto", "and"]
MAX_TOKENS = 24


class BadWords(LogitsProcessor):
    """vLLM's rule for transformers' generate (whose NoBadWordsLogitsProcessor also matches a prefix in
    the prompt): a word's last token banned where the output ends with the tokens before it."""

    def __init__(self, prompt_len: int, sequences: list[list[int]]):
        self.prompt_len, self.sequences = prompt_len, sequences

    def __call__(self, input_ids, scores):
        output = input_ids[0, self.prompt_len :].tolist()
        for ids in self.sequences:
            if len(ids) == 1 or output[len(output) - len(ids) + 1 :] == ids[:-1]:
                scores[0, ids[-1]] = float("-inf")
        return scores


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    tokenizer = llm.engine.tokenizer
    sequences = llm.engine._bad_words_token_ids(WORDS)
    assert [tokenizer.decode(ids) for ids in sequences] == [
        "the earth",
        " the earth",
        "unto",
        " unto",
        "and",
        " and",
    ]
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected.append(greedy_with(hf, ids, MAX_TOKENS, BadWords(len(ids), sequences)))
    assert all(a != b.token_ids for a, b in zip(expected, plain, strict=True))  # each output changed
    return expected


@pytest.mark.parametrize("name", first_fast(["default", "odd_chunks", "preemption_uncached", "no_kv_cache"]))
def test_bad_words_match_transformers(reference, name):
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32", **{"num_kv_blocks": 256, **CONFIGS[name]})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=WORDS)
    results = llm.generate(PROMPTS * 3, params)  # three times: enough to preempt in a small pool
    assert [r.token_ids for r in results] == reference * 3
    assert not any(w in r.text for r in results for w in (" the earth", " unto", " and"))
    if name == "preemption_uncached":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()


def test_the_last_token_is_banned_only_after_its_prefix_in_the_output():
    """[3, 4] bans 4 only right after a 3 that the request generated; [7] bans 7 always."""
    params = SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=[[3, 4], [7]])
    logits = torch.zeros(1, 10)
    logits[0, [4, 7, 2]] = torch.tensor([5.0, 6.0, 3.0])

    def sample(history: list[int], num_prompt: int) -> int:
        return Sampler()(logits, ["r"], [params], [(history, num_prompt)]).token_ids[0]

    assert sample([1, 3], 2) == 4  # the 3 is the prompt's: 4 stays
    assert sample([1, 3, 5], 2) == 4  # a 5 after it
    assert sample([1, 3, 5, 3], 2) == 2  # the output ends with 3: 4 banned, as 7 always is
    sampler = Sampler()  # a request's state, kept from step to step
    history = [1, 5]
    for _ in range(3):
        history.append(sampler(logits, ["r"], [params], [(history, 2)]).token_ids[0])
    assert history[2:] == [4, 4, 4]
    history.append(3)  # (as if sampled)
    assert sampler(logits, ["r"], [params], [(history, 2)]).token_ids[0] == 2
