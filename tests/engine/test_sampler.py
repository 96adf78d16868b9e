"""The batched sampler: filters, seeds independent of the batch, logprobs, logit_bias and penalties."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from infer.runner.sampler import Adjustment, Sampler, adjusted
from infer.sampling_params import SamplingParams


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_rows(4)
    out = Sampler()(logits, list("abcd"), [SamplingParams(temperature=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_bf16_logits_sample_as_their_float32_values():
    """The runner hands over the LM head's bf16 logits; every path equals the same logits upcast first."""
    logits = (logits_rows(6, vocab=4096) * 4).bfloat16()
    logits[2, [5, 9]] = logits[2].max() + 1  # equal maxima: the first wins, as torch.argmax
    for params in (
        [SamplingParams(temperature=0, logprobs=3)] * 6,
        [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, logprobs=2) for i in range(6)],
    ):
        got = Sampler(1)(logits, list("abcdef"), params)
        expected = Sampler(1)(logits.float(), list("abcdef"), params)
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
    assert Sampler()(logits, list("abcdef"), [SamplingParams(temperature=0)] * 6).token_ids[2] == 5


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = logits_rows(6)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5) for i in range(6)]
    for seed in range(5):
        out = Sampler(seed)(logits, list("abcdef"), params)
        assert [out.token_ids[i] for i in (1, 3, 5)] == logits.argmax(-1)[[1, 3, 5]].tolist()


class _SortedRows(torch.overrides.TorchFunctionMode):
    """The rows of every sort and topk the sampler runs."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("sort", "topk"):
            self.rows.append(args[0].shape[0])
        return func(*args, **kwargs or {})


def test_a_greedy_row_beside_sampled_ones_sorts_none_of_them():
    """A greedy stream in a batch of 128 sampled rows (n = 128) is the max of its own row: sorting every
    row's logits for it took longer than the model's step."""
    logits = logits_rows(129, vocab=4096)
    params = [SamplingParams(temperature=0), *[SamplingParams(temperature=1.0)] * 128]
    with _SortedRows() as mode:
        out = Sampler(0)(logits, [str(i) for i in range(129)], params)
    assert out.token_ids[0] == int(logits[0].argmax()) and mode.rows == [1]
    params = [SamplingParams(temperature=1.0, top_p=0.5), *params[1:]]  # top_p: its row alone too
    with _SortedRows() as mode:
        Sampler(0)(logits, [str(i) for i in range(129)], params)
    assert mode.rows == [1]


def test_filters_on_some_rows_equal_each_row_filtered_alone():
    logits = logits_rows(8, vocab=300)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.2, top_k=40, top_p=0.8, min_p=0.01),
        SamplingParams(temperature=1.0, top_k=1000),
        SamplingParams(temperature=0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    together = Sampler(0)._filtered_probs(logits, params)
    for row, p in enumerate(params):
        assert torch.equal(together[row], Sampler(0)._filtered_probs(logits[row : row + 1], [p])[0]), p


def test_seeded_request_ignores_its_batch():
    target = logits_rows(1, seed=7)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(0)
    crowd = Sampler(99)
    for step in range(20):
        a = alone(target, ["x"], [params]).token_ids[0]
        batch = torch.cat([logits_rows(3, seed=step), target])
        others = [SamplingParams(temperature=1.0)] * 3
        b = crowd(batch, ["o1", "o2", "o3", "x"], [*others, params]).token_ids[3]
        assert a == b


def test_top_k_and_min_p_and_top_p_restrict_the_support():
    logits = logits_rows(1)
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)
    sampler = Sampler(0)
    seen_k = {sampler(logits, ["r"], [SamplingParams(top_k=3)]).token_ids[0] for _ in range(200)}
    assert seen_k <= set(order[:3]) and len(seen_k) >= 2
    nucleus = next(i for i in range(50) if probs[order[: i + 1]].sum() >= 0.6) + 1
    seen_p = {sampler(logits, ["r"], [SamplingParams(top_p=0.6)]).token_ids[0] for _ in range(300)}
    assert seen_p <= set(order[:nucleus])
    keep = {i for i in range(50) if probs[i] >= 0.2 * probs.max()}
    seen_m = {sampler(logits, ["r"], [SamplingParams(min_p=0.2)]).token_ids[0] for _ in range(300)}
    assert seen_m <= keep


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, ["r"], [SamplingParams()]).token_ids[0]] += 1
    for got, p in zip(counts, (0.5, 0.3, 0.2), strict=True):
        assert abs(got / 3000 - p) < 0.04


def test_a_token_without_mass_is_never_drawn():
    """Banned tokens (logit -inf) first, in the middle and last: 4,000 draws in a batch of one row each
    way never land on them, and the rest follow their probabilities."""
    inf = float("-inf")
    rows = torch.tensor([[inf, inf, 0.0, inf, math.log(3.0), inf], [0.0, inf, inf, inf, inf, inf]])
    sampler = Sampler(0)
    counts = [0] * 6
    for _ in range(4000):
        got = sampler(rows, ["a", "b"], [SamplingParams(), SamplingParams()]).token_ids
        counts[got[0]] += 1
        assert got[1] == 0
    assert counts[0] == counts[1] == counts[3] == counts[5] == 0
    assert abs(counts[4] / 4000 - 0.75) < 0.03


def test_a_draw_rounded_up_to_the_total_takes_the_last_token_with_mass(monkeypatch):
    rows = torch.tensor([[0.0, 1.0, float("-inf")]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw.get("dtype")))
    assert Sampler(0)(rows, ["r"], [SamplingParams()]).token_ids == [1]


def test_a_seeded_row_draws_one_number_of_its_generator_a_step():
    """One uniform a row and step (the exponential race drew one per token of the vocabulary)."""
    sampler = Sampler(0)
    for _ in range(3):
        sampler(logits_rows(2, vocab=1000), ["s", "o"], [SamplingParams(seed=5), SamplingParams()])
    expected = torch.Generator().manual_seed(5)
    torch.rand(3, generator=expected, dtype=torch.float64)
    assert torch.equal(sampler.request_generators["s"].get_state(), expected.get_state())


def test_logprobs_of_sampled_and_top_tokens():
    logits = logits_rows(2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = Sampler()(logits, ["a", "b"], params)
    sampled, top = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(sampled, ref.max().item(), rel_tol=1e-5)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def openai_penalties(logits, prompt, output, presence, frequency, repetition):
    """The formulas as OpenAI's parameter docs and vLLM write them, one token at a time."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_penalties_follow_openai_and_vllm():
    logits = logits_rows(3, vocab=40)
    logits[1, 7] = float("-inf")  # a banned token stays banned
    prompt, output = [3, 5, 5, 7, 9], [5, 11, 11, 11, 2]
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3),
        SamplingParams(temperature=0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.7),
        SamplingParams(temperature=0),
    ]
    histories = [(prompt + output, len(prompt)), (prompt + output, len(prompt)), None]
    got = adjusted(logits, params, histories)
    for row, p in enumerate(params[:2]):
        expected = openai_penalties(
            logits[row], prompt, output, p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        )
        torch.testing.assert_close(got[row], expected)
    assert got[1, 7] == float("-inf")
    assert torch.equal(got[2], logits[2])  # a row without them is untouched
    out = Sampler()(logits, list("abc"), params, histories)
    assert out.token_ids == got.argmax(-1).tolist()


def test_repetition_penalty_is_transformers():
    logits = logits_rows(2, vocab=64, seed=4)
    sequences = [[1, 4, 4, 9, 30, 63], [2, 8, 50]]
    for penalty in (1.2, 0.6):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        params = [SamplingParams(repetition_penalty=penalty)] * 2
        got = adjusted(logits, params, [(seq, 2) for seq in sequences])
        for row, seq in enumerate(sequences):
            expected = processor(torch.tensor([seq]), logits[row : row + 1].clone())[0]
            torch.testing.assert_close(got[row], expected)


def test_logit_bias_steers_greedy_and_sampled_rows_but_not_logprobs():
    logits = logits_rows(2, vocab=30).bfloat16()
    bias = {int(logits[0].argmin()): 100.0, int(logits[0].argmax()): -100.0}
    params = [
        SamplingParams(temperature=0, logit_bias=bias, logprobs=1),
        SamplingParams(temperature=0.7, logit_bias={13: 100.0}),
    ]
    for seed in range(5):
        out = Sampler(seed)(logits, ["a", "b"], params)
        assert out.token_ids == [int(logits[0].argmin()), 13]
    sampled, top = out.logprobs[0]  # the model's own distribution, as vLLM reports it
    ref = torch.log_softmax(logits[0].float(), -1)
    assert math.isclose(sampled, ref.min().item(), rel_tol=1e-5)
    assert [t for t, _ in top] == [int(ref.argmax())]


def test_the_batchs_biases_in_one_add_equal_each_token_added_in_order():
    """adjusted() adds every row's logit_bias in one index_add_ over the batch: the same values as adding
    each token's bias to its row between the bans and the penalties (the order vLLM applies them in)."""
    vocab = 2048
    logits = logits_rows(5, vocab=vocab, seed=3).bfloat16()
    big = {t: (t % 7 - 3) * 10.0 for t in range(100, 1124)}  # 1,024 entries
    params = [
        SamplingParams(temperature=0, logit_bias=big),
        SamplingParams(temperature=0),  # no adjustment: untouched
        SamplingParams(temperature=0.5, logit_bias={5: 3.0, 7: -100.0}, repetition_penalty=1.5),
        SamplingParams(temperature=0, logit_bias={9: 50.0, 11: 1.0}, allowed_token_ids=[9, 10, 11]),
        SamplingParams(temperature=0, logit_bias=big, presence_penalty=1.0, frequency_penalty=0.5),
    ]
    histories = [None, None, ([5, 9, 7, 5], 2), None, ([100, 101, 101], 1)]
    got = adjusted(logits, params, histories)

    want = logits.float().clone()
    for row, p in enumerate(params):
        if not p.has_adjustment:
            continue
        state = Adjustment(p)
        if p.needs_history:
            state.fold(*histories[row])
        state.ban(want[row])
        for token_id, bias in p.logit_bias.items():  # one token at a time
            want[row, token_id] += bias
        state.penalize(want[row])
    assert torch.equal(got, want)
    reference = logits.float().clone()  # and Adjustment.apply, one row at a time, agrees
    for row, p in enumerate(params):
        if p.has_adjustment:
            state = Adjustment(p)
            if p.needs_history:
                state.fold(*histories[row])
            state.apply(reference[row])
    assert torch.equal(got, reference)


def test_biases_apply_to_a_strided_batch_of_logits():
    logits = logits_rows(4, vocab=64)[:, ::2]  # not contiguous
    params = [SamplingParams(temperature=0, logit_bias={3: 100.0})] * 4
    got = adjusted(logits, params, [None] * 4)
    assert got.argmax(-1).tolist() == [3] * 4 and torch.equal(got[:, :3], logits[:, :3])


def test_a_tiny_repetition_penalty_stays_finite():
    """A positive logit divided by 1e-30 would overflow float32 (and its sampling give NaN)."""
    logits = logits_rows(1, vocab=20)
    logits[0, 4] = 5.0
    params = [SamplingParams(temperature=1e-4, repetition_penalty=1e-30, seed=1)]
    got = adjusted(logits, params, [([4, 6], 1)])
    assert torch.isfinite(got).all() and int(got.argmax()) == 4
    assert Sampler()(logits, ["a"], params, [([4, 6], 1)]).token_ids == [4]


def test_penalty_and_bias_bounds():
    for kwargs, field in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert not SamplingParams(logit_bias={3: -100}).penalized
    assert SamplingParams(logit_bias={3: -100}).adjusts_logits
    assert SamplingParams(repetition_penalty=1.1).penalized


def test_allowed_token_ids_come_before_the_bias():
    """vLLM's allowed_token_ids: every other token is banned, whatever its logit or bias."""
    logits = logits_rows(2, vocab=30)
    low = int(logits[0].argmin())
    allowed = [low, (low + 1) % 30]
    params = [
        SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias={int(logits[0].argmax()): 100}),
        SamplingParams(temperature=1.0, allowed_token_ids=[3, 4]),
    ]
    got = adjusted(logits, params, [None, None])
    assert torch.isinf(got[0]).sum() == 28 and got[0, low] == logits[0, low]
    for seed in range(20):
        first, second = Sampler(seed)(logits, ["a", "b"], params).token_ids
        assert first == max(allowed, key=lambda t: logits[0, t]) and second in (3, 4)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_overflowing_penalties_leave_no_nan_and_something_to_sample():
    """A repetition penalty past float32's range: no 0 * inf (NaN), no row of -inf, bans kept."""
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, -3.0, float("-inf")]])
    for penalty in (1e39, 1e-39):
        params = [SamplingParams(temperature=0, repetition_penalty=penalty, allowed_token_ids=[2, 4, 5])]
        got = adjusted(logits, params, [([0, 1, 2, 3, 4, 5], 0)])
        assert (
            not torch.isnan(got).any() and torch.isfinite(got[0, [2, 4]]).all() and got[0, 5] == float("-inf")
        )
        assert Sampler()(logits, ["a"], params, [([0, 1, 2, 3, 4, 5], 0)]).token_ids[0] in (2, 4)


def test_a_requests_state_folds_in_only_new_tokens():
    """The Sampler keeps each penalized request's counts between steps: the same logits as built from the
    whole history each time, and gone once the request is forgotten."""
    logits = logits_rows(1, vocab=40, seed=9)
    p = SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.7, repetition_penalty=1.2)
    sampler, history = Sampler(), [3, 5, 5, 9]
    for step in range(6):
        state = sampler._adjustment("r", p)
        got = adjusted(logits, [p], [(history, 4)], [state])
        torch.testing.assert_close(got, adjusted(logits, [p], [(history, 4)]))
        history.append([5, 11, 11, 2, 39, 5][step])
    assert state.num_folded == 9 and "r" in sampler.adjustments
    sampler.forget(["r"])
    assert "r" not in sampler.adjustments
