"""router.stalls: a prompt's prefill as it runs, the stall a decode window met, and the
learned decode-seconds-per-prefill-second factor (answers written out)."""

from __future__ import annotations

import pytest

from router.stalls import Prefill, PrefillStalls, StallConfig


def test_a_prefill_runs_right_before_its_first_token_not_before_it_was_sent() -> None:
    # sent at 1.0, first token predicted at 2.0, 0.3 s of prefill: it runs over [1.7, 2.0]
    assert Prefill.before_first_token(1.0, 2.0, 0.3) == Prefill(1.7, 2.0, 0.3)
    # more prefill than the time to its first token: from the send
    assert Prefill.before_first_token(1.0, 1.2, 0.3) == Prefill(1.0, 1.2, 0.3)


def test_within_counts_the_share_of_the_prefill_inside_a_window() -> None:
    p = Prefill(1.0, 2.0, 0.4)  # 0.4 s of compute spread over one second
    assert p.within_s(1.5, 3.0) == pytest.approx(0.2)  # half of it
    assert p.within_s(0.0, 5.0) == pytest.approx(0.4)
    assert p.within_s(2.0, 3.0) == 0.0 and p.within_s(0.0, 1.0) == 0.0
    assert Prefill(1.0, 1.0, 0.1).within_s(0.5, 1.5) == pytest.approx(0.1)  # zero-length


def test_overlap_sums_every_prompt_routed_to_the_worker() -> None:
    s = PrefillStalls()
    s.record("w", sent_s=0.0, first_token_s=1.0, prefill_s=0.2)  # runs over [0.8, 1.0]
    s.record("w", sent_s=0.5, first_token_s=2.0, prefill_s=1.0)  # runs over [1.0, 2.0]
    s.record("v", sent_s=0.0, first_token_s=1.0, prefill_s=5.0)  # another worker
    s.record("w", sent_s=0.0, first_token_s=1.0, prefill_s=0.0)  # nothing to prefill
    # window [0.9, 1.5]: half of the first (0.1) and half of the second (0.5)
    assert s.overlap_s("w", 0.9, 1.5) == pytest.approx(0.6)
    assert s.overlap_s("nobody", 0.0, 9.0) == 0.0


def test_the_events_kept_per_worker_are_bounded() -> None:
    s = PrefillStalls(StallConfig(max_events=2))
    for t in range(5):
        s.record("w", float(t), t + 1.0, 1.0)
    assert s.overlap_s("w", 0.0, 10.0) == pytest.approx(2.0)  # the last two


def test_the_factor_starts_at_the_prior_and_learns_a_slope_through_the_origin() -> None:
    s = PrefillStalls(StallConfig(prior_samples=20.0, forgetting=0.99))
    assert s.factor("w") == 1.0  # unknown worker
    s.set_prior("w", 1.0)
    s.observe("w", 0.0, 0.5)  # no stall met: says nothing about the factor
    assert s.factor("w") == 1.0
    for _ in range(100):  # every request lost half the prefill it met: 5 ms of 10 ms
        s.observe("w", 0.010, 0.005)
    # prior worth 20 samples of the mean squared stall (1e-4); the samples' weight with
    # forgetting: sum_{k<100} 0.99^k = 63.40; slope = (20 x 1 + 63.40 x 0.5) / (20 + 63.40)
    assert s.factor("w") == pytest.approx((20 + 63.397 * 0.5) / (20 + 63.397), rel=1e-3)
    assert s.snapshot() == {"w": [round(s.factor("w"), 4), 100]}


def test_the_factor_is_bounded_and_a_reload_restarts_it() -> None:
    s = PrefillStalls()
    s.set_prior("w", 0.5)  # two engine cores
    for _ in range(200):
        s.observe("w", 0.01, 1.0)  # 100x the stall: capped at twice the prior
    assert s.factor("w") == 1.0
    for _ in range(2000):
        s.observe("w", 0.01, -1.0)  # TPOT below the profile's whenever stalled: not < 0
    assert s.factor("w") == 0.0
    s.forget_worker("w")
    assert s.factor("w") == 1.0
    s.set_prior("w", 0.5)
    assert s.factor("w") == 0.5


@pytest.mark.parametrize("kw", [{"max_events": 0}, {"prior_samples": 0.0}, {"forgetting": 0.5},
                                {"forgetting": 1.5}])
def test_config_is_validated(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StallConfig(**kw)  # type: ignore[arg-type]


def test_bad_numbers_are_ignored() -> None:
    s = PrefillStalls()
    s.set_prior("w", 1.0)
    for bad in (float("nan"), float("inf"), -1.0):
        s.record("w", 0.0, 1.0, bad)
        s.record("w", 0.0, bad, 0.5)  # a NaN first token would poison every later overlap
        s.observe("w", bad, 0.01)
        s.observe("w", 0.01, float("nan"))
    s.record("w", 0.0, 1.0, 0.5)
    assert s.overlap_s("w", 0.0, 2.0) == pytest.approx(0.5)
    assert s.factor("w") == 1.0 and s.snapshot() == {"w": [1.0, 0]}
