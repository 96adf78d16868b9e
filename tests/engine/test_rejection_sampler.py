"""Verifying proposals: greedy acceptance (vLLM's tests/v1/sample/test_rejection_sampler.py cases) and
rejection sampling that keeps the target's distribution (chi-square against the exact probabilities)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from infer.core.outputs import ScheduledRequest
from infer.runner.rejection_sampler import accept_greedy, accept_sampled, verify
from infer.runner.sampler import Sampler
from infer.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def scheduled(req_id: str, draft: list[int], params: SamplingParams, history: list[int] | None = None):
    history = history if history is not None else [0, 1, 2]
    return ScheduledRequest(
        req_id=req_id,
        token_ids=[history[-1], *draft],
        start_pos=len(history) - 1,
        block_ids=[0],
        sample=True,
        sampling_params=params,
        num_prompt_tokens=2,
        history=history,
        spec_token_ids=draft,
    )


def one_hot_logits(targets: list[int]) -> torch.Tensor:
    logits = torch.full((len(targets), VOCAB), -5.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft, targets, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # perfect match: all kept, the bonus token after them
        ([1, 2, 3], [1, 5, 3, 4], [1, 5]),  # early mismatch: the target's token there, then stop
        ([1, 2], [3, 2, 4], [3]),  # first proposal wrong: only the target's token
        ([1], [1, 2], [1, 2]),  # single proposal
        ([], [5], [5]),  # no proposal: plain sampling
        ([1, 2, 3], [1, 2, 5, 4], [1, 2, 5]),  # mismatch at the last proposal
    ],
)
def test_greedy_acceptance(draft, targets, expected):
    assert accept_greedy(draft, targets) == expected
    got = verify(
        Sampler(), one_hot_logits(targets), [scheduled("a", draft, SamplingParams(temperature=0))], [EOS]
    )
    assert got == [expected]


def test_greedy_acceptance_for_several_requests_in_one_batch():
    drafts = [[1, 2], [3], [4, 5, 6]]
    targets = [[1, 3, 4], [3, 5], [4, 5, 6, 1]]
    reqs = [scheduled(f"r{i}", d, SamplingParams(temperature=0)) for i, d in enumerate(drafts)]
    logits = one_hot_logits([t for row in targets for t in row])
    assert verify(Sampler(), logits, reqs, [EOS]) == [[1, 3], [3, 5], [4, 5, 6, 1]]


def test_min_tokens_and_logit_bias_hold_at_every_proposed_position():
    """min_tokens bans EOS until that many outputs exist, counting the accepted proposals before the
    row; logit_bias applies to every row."""
    logits = one_hot_logits([EOS, EOS, EOS])  # the model wants to stop at once
    logits[:, 4] = 4.0  # and 4 next
    params = SamplingParams(temperature=0, min_tokens=2)  # 1 output so far (history 0 1 | 2)
    (got,) = verify(Sampler(), logits.clone(), [scheduled("a", [4, EOS], params)], [EOS])
    # row 0: 1 output before it, EOS banned; row 1: 2 before it, EOS allowed (the scheduler ends the
    # request there and drops what follows)
    assert got == [4, EOS, EOS]
    params = SamplingParams(temperature=0, logit_bias={3: 100.0})
    (got,) = verify(Sampler(), logits.clone(), [scheduled("a", [3, 3], params)], [EOS])
    assert got == [3, 3, 3]


def test_penalties_see_the_proposals_before_each_row():
    """A repetition penalty at row j counts proposals 1..j as generated: a proposal that the penalty
    turns away is rejected as the plain sampler would turn it away one step later."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    (got,) = verify(Sampler(), logits, [scheduled("a", [5, 5], params, history=[0, 1, 2])], [EOS])
    assert got == [5, 6]  # row 0: 5 unseen, kept; row 1: 5 seen (2.0 / 2 < 1.5): 6


def sampled_counts(probs: torch.Tensor, draft: list[int], num: int, seed: int = 0):
    """Counts of the first emitted token, and of the second given that the first proposal was kept."""
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(num):
        out = accept_sampled(draft, probs, gen)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
    return first, second


def assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("draft_token", [0, 3, 5])  # likely, unlikely, impossible under the target
def test_rejection_sampling_keeps_the_target_distribution(draft_token):
    probs = torch.tensor(
        [
            [0.40, 0.05, 0.15, 0.10, 0.20, 0.00, 0.05, 0.05],
            [0.10, 0.30, 0.05, 0.05, 0.25, 0.05, 0.10, 0.10],
        ]
    )
    first, second = sampled_counts(probs, [draft_token], num=6000)
    assert_distributed_as(first, probs[0])
    if draft_token != 5:
        assert second.sum() == first[draft_token]  # a kept proposal is always followed by a token
        assert_distributed_as(second, probs[1])
    assert first[draft_token] / first.sum() == pytest.approx(float(probs[0, draft_token]), abs=0.03)


def test_verify_samples_from_the_filtered_target():
    """Through verify: temperature and top-k shape the target the proposals are checked against."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]] * 2)
    params = SamplingParams(temperature=0.7, top_k=3, seed=1)
    sampler, first = Sampler(), torch.zeros(VOCAB)
    for _ in range(2000):
        (out,) = verify(sampler, logits.clone(), [scheduled("a", [1], params)], [EOS])
        first[out[0]] += 1
    target = torch.softmax(logits[0, :3] / 0.7, dim=-1)
    assert_distributed_as(first, torch.cat([target, torch.zeros(VOCAB - 3)]))
