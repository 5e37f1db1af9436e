"""verify(): greedy answers written out, k = 0 equals plain sampling, and losslessness.

The statistical tests compare speculative sampling's output distribution with
the target distribution p on a small vocabulary, and check that the same test
catches two classic bugs (always accepting; resampling from p instead of the
residual max(0, p - q)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from scipy.stats import chi2

import specdec.verify as verify_mod
from polyinfer.sampling import SamplingParams, process_logits, sample
from specdec.base import Proposal
from specdec.errors import VerifyInputError
from specdec.verify import FIRST_WAVE_ROWS, VerifyResult, verify, verify_greedy_in_waves

GREEDY = SamplingParams(0.0)


def _logits_for_argmax(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_mixed_depths_expected_answers() -> None:
    proposals = [
        Proposal(10, [3, 4, 5]),  # argmax 3, 4, 1 -> accept 2, then 1
        Proposal(11, []),  # depth 0 -> just the argmax 6
        Proposal(12, [2, 2]),  # argmax 7 -> reject at once, then 7
        Proposal(13, [1]),  # argmax 1, bonus 0 -> accept all + bonus
    ]
    argmaxes = [3, 4, 1, 2] + [6] + [7, 2, 2] + [1, 0]
    out = verify(_logits_for_argmax(argmaxes), proposals, [GREEDY] * 4)
    assert out == [
        VerifyResult(10, [3, 4, 1], 2, 3),
        VerifyResult(11, [6], 0, 0),
        VerifyResult(12, [7], 0, 2),
        VerifyResult(13, [1, 0], 1, 1),
    ]


def _scorer(argmax: list[int], scored: list[int]) -> Callable[[list[int]], list[int]]:
    def score(rows: list[int]) -> list[int]:
        scored.extend(rows)
        return [argmax[r] for r in rows]
    return score


def test_greedy_in_waves_scores_only_the_rows_it_reads() -> None:
    # row argmaxes: seq 1 (12 drafts) rejects at draft 1; seq 2 (5 drafts) accepts all
    argmax = [7, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0] + [1, 2, 3, 4, 5, 6]
    proposals = [Proposal(1, [7] * 12), Proposal(2, [1, 2, 3, 4, 5])]
    scored: list[int] = []
    got = verify_greedy_in_waves(_scorer(argmax, scored), proposals)
    assert got == [VerifyResult(1, [7, 3], 1, 12), VerifyResult(2, [1, 2, 3, 4, 5, 6], 5, 5)]
    # wave 1: the first 4 rows of each; wave 2: the rest of seq 2 only
    assert scored == [0, 1, 2, 3, 13, 14, 15, 16, 17, 18]
    assert FIRST_WAVE_ROWS == 4


def test_greedy_in_waves_equals_verify() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        depths = torch.randint(0, 14, (int(torch.randint(1, 6, (1,), generator=gen)),),
                               generator=gen).tolist()
        logits = torch.randn(sum(k + 1 for k in depths), 16, generator=gen)
        argmax = logits.argmax(dim=1).tolist()
        proposals, row = [], 0
        for i, k in enumerate(depths):
            right = torch.rand(k, generator=gen) < 0.8  # mostly the argmax, sometimes not
            proposals.append(Proposal(i, [argmax[row + j] if right[j] else
                                          (argmax[row + j] + 1) % 16 for j in range(k)]))
            row += k + 1
        scored: list[int] = []
        got = verify_greedy_in_waves(_scorer(argmax, scored), proposals)
        assert got == verify(logits, proposals, [GREEDY] * len(depths))
        assert len(scored) == len(set(scored))  # no row scored twice
        # a proposal decided in the first wave costs at most FIRST_WAVE_ROWS rows
        assert len(scored) == sum(min(k + 1, FIRST_WAVE_ROWS) if r.num_accepted < FIRST_WAVE_ROWS
                                  else k + 1 for k, r in zip(depths, got, strict=True))


def test_greedy_rows_in_a_sampled_batch_still_match_argmax() -> None:
    argmaxes = [3, 4, 1, 2] + [5, 5]
    proposals = [Proposal(1, [3, 4, 5]), Proposal(2, [5])]
    out = verify(_logits_for_argmax(argmaxes), proposals, [GREEDY, SamplingParams(0.7)])
    assert out[0] == VerifyResult(1, [3, 4, 1], 2, 3)
    assert out[1].num_draft == 1 and len(out[1].tokens) == out[1].num_accepted + 1


def test_depth_zero_equals_plain_sampling_with_the_same_generator() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    params = [dict(temperature=t, top_p=tp, top_k=tk)
              for t, tp, tk in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.0, 1.0, 0),
                                (0.5, 0.8, 10)]]
    plain = sample(logits, [SamplingParams.seeded(100 + i, **p) for i, p in enumerate(params)])
    spec = verify(logits, [Proposal(i, []) for i in range(5)],
                  [SamplingParams.seeded(100 + i, **p) for i, p in enumerate(params)])
    assert [r.tokens[0] for r in spec] == plain.tolist()
    assert all(r.num_accepted == 0 for r in spec)


def test_greedy_speculative_decoding_equals_argmax_decoding() -> None:
    """Speculative greedy decoding with a recomputing target reproduces plain argmax decoding."""
    torch.manual_seed(0)
    vocab = 16
    table = torch.randn(vocab, vocab) * 3  # next-token logits depend on the last two tokens
    mix = torch.randn(vocab, vocab) * 3

    def target(tokens: list[int]) -> torch.Tensor:  # logits after each prefix: [len, vocab]
        t = torch.tensor(tokens)
        prev = torch.cat([t[:1], t[:-1]])
        return table[t] + mix[prev]

    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = list(prompt)
    for _ in range(30):
        plain.append(int(target(plain)[-1].argmax()))
    spec = list(prompt)
    gen = torch.Generator().manual_seed(5)
    while len(spec) < len(plain):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        guess = [int(torch.randint(0, vocab, (1,), generator=gen)) for _ in range(k)]
        # half the time propose the true continuation, to exercise acceptance
        if k and int(torch.randint(0, 2, (1,), generator=gen)):
            guess = plain[len(spec) : len(spec) + k]
            guess += [0] * (k - len(guess))
        logits = target(spec + guess)[len(spec) - 1 :]
        res = verify(logits, [Proposal(0, guess)], [GREEDY])[0]
        spec.extend(res.tokens)
    assert spec[: len(plain)] == plain


# ---------------------------------------------------------------- losslessness
VOCAB = 6
NUM_SEQS = 4000  # sequences per verify() call
NUM_CALLS = 4
DEPTH = 3


def _fixed_target_logits() -> torch.Tensor:
    # per position j in 0..DEPTH: logits that do not depend on the context
    return torch.tensor([[1.0, 0.5, -0.3, 2.0, 0.0, -1.0],
                         [0.2, 1.5, 0.1, -0.5, 1.0, 0.0],
                         [-1.0, 0.0, 2.0, 0.5, 0.3, 0.1],
                         [0.0, 0.0, 1.0, 1.0, -2.0, 0.5]])


DRAFT_Q = torch.tensor([[0.05, 0.5, 0.05, 0.1, 0.2, 0.1]] * DEPTH)  # a poor draft


def emitted_counts(verifier: Callable[..., list[VerifyResult]], params: SamplingParams,
                   with_probs: bool, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second given that one is emitted."""
    logits_one = _fixed_target_logits().to(device)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    gen = torch.Generator().manual_seed(123)
    for _ in range(NUM_CALLS):
        if with_probs:
            drafts = torch.multinomial(DRAFT_Q, NUM_SEQS, replacement=True, generator=gen).T
            q = DRAFT_Q.to(device)
            proposals = [Proposal(i, drafts[i].tolist(), q) for i in range(NUM_SEQS)]
        else:
            proposals = [Proposal(i, [1, 4, 2]) for i in range(NUM_SEQS)]
        logits = logits_one.repeat(NUM_SEQS, 1)
        for r in verifier(logits, proposals, [params] * NUM_SEQS):
            first[r.tokens[0]] += 1
            if len(r.tokens) > 1:
                second[r.tokens[1]] += 1
    return first, second


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives probability 0"
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def target_probs(params: SamplingParams) -> torch.Tensor:
    return process_logits(_fixed_target_logits(), [params] * (DEPTH + 1))


# NOTE: significance 1e-6 keeps a false failure negligible (the seeds are fixed anyway);
# the biased samplers below land at p-values far below it with these sample sizes.
ALPHA = 1e-6
SAMPLED = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9), SamplingParams(1.2, top_k=4)]


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft-probs", "point-mass"])
@pytest.mark.parametrize("params", SAMPLED, ids=["t1", "t0.8-p0.9", "t1.2-k4"])
def test_speculative_sampling_matches_target_distribution(params: SamplingParams,
                                                          with_probs: bool) -> None:
    torch.manual_seed(7)
    first, second = emitted_counts(verify, params, with_probs)
    p = target_probs(params)
    assert chi_square_p_value(first, p[0]) > ALPHA
    assert second.sum() > 500  # enough second tokens to test
    assert chi_square_p_value(second, p[1]) > ALPHA


def _always_accept(logits: torch.Tensor, proposals: Sequence[Proposal],
                   sampling: Sequence[SamplingParams]) -> list[VerifyResult]:
    """A deliberately biased verifier: keeps every draft token, then samples the bonus."""
    rows = torch.tensor([(len(p.tokens) + 1) * i + len(p.tokens) for i, p in enumerate(proposals)])
    bonus = sample(logits[rows], sampling).tolist()
    return [VerifyResult(p.seq_id, p.tokens + [b], len(p.tokens), len(p.tokens))
            for p, b in zip(proposals, bonus, strict=True)]


def test_statistical_test_fails_for_an_always_accepting_sampler() -> None:
    torch.manual_seed(7)
    first, _ = emitted_counts(_always_accept, SamplingParams(1.0), with_probs=True)
    assert chi_square_p_value(first, target_probs(SamplingParams(1.0))[0]) < ALPHA


def test_statistical_test_fails_when_resampling_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "_residual", lambda p, q: p)  # the classic bug
    torch.manual_seed(7)
    first, _ = emitted_counts(verify_mod.verify, SamplingParams(1.0), with_probs=True)
    assert chi_square_p_value(first, target_probs(SamplingParams(1.0))[0]) < ALPHA


def test_acceptance_rate_matches_theory() -> None:
    """E[accept] at one position = sum_x min(p(x), q(x)) (Leviathan et al., Thm 3.5)."""
    torch.manual_seed(3)
    params = SamplingParams(1.0)
    first, second = emitted_counts(verify, params, with_probs=True)
    p0 = target_probs(params)[0]
    alpha = float(torch.minimum(p0, DRAFT_Q[0]).sum())
    n = NUM_SEQS * NUM_CALLS
    observed = float(second.sum()) / n  # a second token is emitted iff the first draft is accepted
    assert observed == pytest.approx(alpha, abs=5 * math.sqrt(alpha * (1 - alpha) / n))


# ---------------------------------------------------------------- bad input
def test_logit_rows_must_match_proposals() -> None:
    with pytest.raises(VerifyInputError, match="sum of k_i"):
        verify(torch.zeros(3, 8), [Proposal(0, [1, 2, 3])], [GREEDY])


def test_sampling_count_must_match() -> None:
    with pytest.raises(VerifyInputError, match="sampling"):
        verify(torch.zeros(2, 8), [Proposal(0, [1])], [GREEDY, GREEDY])


def test_token_outside_vocab_raises() -> None:
    with pytest.raises(VerifyInputError, match="outside"):
        verify(torch.zeros(2, 8), [Proposal(0, [8])], [GREEDY])


def test_draft_probs_shape_checked() -> None:
    with pytest.raises(VerifyInputError, match="draft probs"):
        verify(torch.zeros(2, 8), [Proposal(0, [1], torch.ones(1, 7) / 7)], [SamplingParams(1.0)])


def test_empty_batch() -> None:
    assert verify(torch.zeros(0, 8), [], []) == []


def test_seeded_verification_emits_the_plain_keyed_samples() -> None:
    """With a seed, whatever is drafted, verification emits what plain decoding emits."""
    from polyinfer.sampling import Row

    torch.manual_seed(4)
    vocab, k = 12, 5
    logits = torch.randn(k + 1, vocab)  # position j's logits do not depend on the drafts
    params = SamplingParams.seeded(77, 0.9, top_p=0.95)
    plain = [int(sample(logits[j:j + 1], [params], [Row(30 + j)])[0]) for j in range(k + 1)]
    gen = torch.Generator().manual_seed(2)
    for num_right in range(k + 1):
        wrong = [(t + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab
                 for t in plain[num_right:k]]
        drafts = plain[:num_right] + wrong
        q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=1)
        for probs in (None, q):
            got = verify(logits, [Proposal(0, drafts, probs)], [params], [Row(30)])[0]
            assert got.num_accepted == num_right
            assert got.tokens == plain[:num_right + 1]
