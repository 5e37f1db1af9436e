"""process_logits / sample: the one sampler that plain and speculative decoding share."""

from __future__ import annotations

import math

import pytest
import torch

from polyinfer.sampling import (
    SamplingError,
    SamplingParams,
    process_logits,
    sample,
    sample_from_probs,
)

LOGITS = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))


def _probs(**kwargs: float) -> list[float]:
    out = process_logits(LOGITS, [SamplingParams(**kwargs)])  # type: ignore[arg-type]
    return [round(x, 4) for x in out[0].tolist()]


def test_temperature_one_is_softmax() -> None:
    assert _probs(temperature=1.0) == [0.1, 0.4, 0.2, 0.3]


def test_greedy_is_point_mass_on_argmax() -> None:
    assert _probs(temperature=0.0) == [0.0, 1.0, 0.0, 0.0]


def test_temperature_sharpens() -> None:
    # p^2 normalised: [0.01, 0.16, 0.04, 0.09] / 0.30
    assert _probs(temperature=0.5) == [0.0333, 0.5333, 0.1333, 0.3]


def test_top_k_keeps_k_most_likely() -> None:
    assert _probs(temperature=1.0, top_k=2) == [0.0, 0.5714, 0.0, 0.4286]  # 0.4, 0.3 renormalised


def test_top_p_keeps_smallest_nucleus() -> None:
    # sorted 0.4, 0.3, 0.2, 0.1: mass before each 0, 0.4, 0.7, 0.9; top_p=0.7 keeps 0.4 and 0.3
    assert _probs(temperature=1.0, top_p=0.7) == [0.0, 0.5714, 0.0, 0.4286]
    assert _probs(temperature=1.0, top_p=0.71) == [0.0, 0.4444, 0.2222, 0.3333]
    assert _probs(temperature=1.0, top_p=0.01) == [0.0, 1.0, 0.0, 0.0]


def test_top_k_then_top_p() -> None:
    # top_k=3 -> [0.4, 0.3, 0.2]/0.9; mass before: 0, 0.444, 0.778; top_p=0.5 keeps two
    assert _probs(temperature=1.0, top_k=3, top_p=0.5) == [0.0, 0.5714, 0.0, 0.4286]


def test_rows_are_processed_independently() -> None:
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(1.0, top_k=1)]
    out = process_logits(logits, params)
    assert out[0].tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3], abs=1e-6)
    assert out[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert out[2].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(4, 50)
    a = sample(logits, [SamplingParams.seeded(s, 1.0) for s in range(4)])
    b = sample(logits, [SamplingParams.seeded(s, 1.0) for s in range(4)])
    assert a.tolist() == b.tolist()


def test_sample_frequencies_follow_probs() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens = sample_from_probs(probs, [SamplingParams(1.0)] * probs.shape[0])
    freq = torch.bincount(tokens, minlength=4).float() / probs.shape[0]
    # 5 standard errors of the largest-variance cell
    tol = 5 * math.sqrt(0.25 / probs.shape[0])
    assert freq.tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3], abs=tol)


def test_zero_probability_tokens_are_never_sampled() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(5000, 1)
    tokens = sample_from_probs(probs, [SamplingParams(1.0)] * 5000)
    assert set(tokens.tolist()) <= {1, 3}


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"top_k": -1}, {"temperature": math.nan}])
def test_bad_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logits_shape_mismatch_raises() -> None:
    with pytest.raises(SamplingError):
        process_logits(torch.zeros(2, 4), [SamplingParams(1.0)])


# ---------------------------------------------------------------- adjustments and keyed draws
from polyinfer.sampling import Row, adjust_logits, keyed_sample  # noqa: E402


def test_penalties_follow_vllm_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    row = Row(10, prompt_ids=[3], output_ids=[0, 0], drafts=[2])
    p = SamplingParams(1.0, presence_penalty=0.5, frequency_penalty=0.25,
                       repetition_penalty=2.0)
    out = adjust_logits(logits.clone(), [p], [row])[0].tolist()
    # token 0: seen (output x2): 2/2 - 0.25*2 - 0.5 = 0; token 2 (a draft before the row):
    # 0.5/2 - 0.25 - 0.5 = -0.5; token 3 in the prompt only: 1/2 (no presence/frequency)
    assert out == pytest.approx([0.0, -1.0, -0.5, 0.5])
    # a negative logit is multiplied by the repetition penalty
    assert adjust_logits(torch.tensor([[-1.0, 0.0]]), [SamplingParams(repetition_penalty=2.0)],
                         [Row(0, output_ids=[0])])[0].tolist() == [-2.0, 0.0]


def test_logit_bias_and_min_tokens_mask() -> None:
    p = SamplingParams(0.0, logit_bias=((1, 5.0),), min_tokens=2, min_tokens_ban=frozenset({3}))
    logits = torch.zeros(2, 4)
    out = adjust_logits(logits, [p, p], [Row(5, output_ids=[0]), Row(6, output_ids=[0, 1])])
    assert out[0].tolist() == [0.0, 5.0, 0.0, float("-inf")]  # 1 output < min_tokens: banned
    assert out[1].tolist() == [0.0, 5.0, 0.0, 0.0]
    assert logits.tolist() == torch.zeros(2, 4).tolist()  # the input is left as it was


def test_keyed_draws_depend_on_seed_and_position_only() -> None:
    probs = torch.softmax(torch.randn(3, 50), dim=1)
    p = [SamplingParams.seeded(9, 1.0)] * 3
    a = keyed_sample(probs, p, [4, 5, 6])
    assert keyed_sample(probs, p, [4, 5, 6]).tolist() == a.tolist()
    # a row's draw does not move when other rows come and go
    assert keyed_sample(probs[1:2], p[:1], [5]).tolist() == a[1:2].tolist()
    # sample_from_probs takes the keyed draw at each row's position
    rows = [Row(4), Row(5), Row(6)]
    assert sample_from_probs(probs, p, rows).tolist() == a.tolist()


def test_keyed_draws_follow_probs() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    n = 20000
    tokens = [int(keyed_sample(probs, [SamplingParams.seeded(1, 1.0)], [pos])[0])
              for pos in range(n)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    tol = 5 * math.sqrt(0.25 / n)
    assert freq.tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3], abs=tol)
