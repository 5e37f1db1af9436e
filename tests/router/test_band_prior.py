"""A new shape bucket's TPOT starts from its prompt band's fit, not from the worker-wide fit
that long prompts' slower decode steps inflate (router.profiles, session 8 round 7: on the
device spec's 800-2,000-token shared-prefix prompts, labelled ``code``, decoded at 4.5 ms a
token and dominated its worker-wide fit, 9.9 ms at batch 1, from which a short repetitive
bucket started: predicted to miss a 2.9-ms SLO on spec, where it took 1.2 ms, it was sent to
batch and long, where it surely missed). Answers written out."""

from __future__ import annotations

import pytest

from polyinfer.config import CompiledConfig, DeclaredFit
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, WorkerView
from router.calibration import Calibration
from router.profiles import LatencyPrior, PriorConfig, WorkerProfile

SPEC = CompiledConfig(fit=DeclaredFit(domains=("translation", "code", "extraction"),
                                      prompt_tokens=(0, 600))).with_engine(
    max_num_seqs=4, max_num_batched_tokens=256, spec_method="ngram", spec_max_depth=4)
BATCH = CompiledConfig(fit=DeclaredFit(domains=("chat", "math", "qa"), prompt_tokens=(0, 600))
                       ).with_engine(max_num_seqs=32, max_num_batched_tokens=256)


def history(band_tpot: bool) -> tuple[WorkerProfile, WorkerProfile]:
    """(spec, batch) profiles sharing one calibration, after the device's early traffic:
    batch decoded 20 short math prompts at 4.6 ms a token, spec 30 long (1,500-token)
    ``code`` prompts at 9 ms; each alone, at depth 0, learned at batch 1."""
    cal = Calibration()
    spec = WorkerProfile(LatencyPrior(SPEC, PriorConfig()), calibration=cal, band_tpot=band_tpot)
    batch = WorkerProfile(LatencyPrior(BATCH, PriorConfig()), calibration=cal,
                          band_tpot=band_tpot)
    for _ in range(20):
        batch.observe("math", 200, 0, 1, 0, 0.02, 0.0046, step_ratio=1.0)
    for _ in range(30):
        spec.observe("code", 1500, 0, 1, 0, 0.3, 0.009, step_ratio=1.0)
    return spec, batch


def tpot_ms(prof: WorkerProfile, domain: str, prompt_tokens: int) -> float:
    return prof.predict(domain, prompt_tokens, 0, 1, 0, step_ratio=1.0).tpot_s * 1e3


def test_a_new_short_bucket_starts_from_the_band_calibration_not_the_long_prompts() -> None:
    spec, batch = history(band_tpot=True)
    # the fleet's calibration for band 0 (< 256 tokens): batch's 4.6 ms against its prior for
    # a declared short math prompt, (20 + 16 / 8) ms x 0.85 = 18.7 ms: 0.246. Spec has no
    # band-0 sample, so a short translation prompt there starts from spec's prior, 22 ms x
    # 0.85 (declared fit) x 0.246 = 4.60 ms; on batch (undeclared: x 1) from batch's band-0
    # fit, ~4.6 / 0.85 = 5.4 ms, not yet there from its 22-ms start (each sample's pull is
    # bounded to a quarter of the prediction): 6.05 ms
    assert tpot_ms(spec, "translation", 200) == pytest.approx(4.60, rel=0.01)
    assert tpot_ms(batch, "translation", 200) == pytest.approx(6.05, rel=0.01)
    # the long prompts' own bucket keeps what they measured
    assert tpot_ms(spec, "code", 1500) == pytest.approx(8.89, rel=0.01)


def test_the_worker_wide_start_is_what_sent_the_repetitive_class_away() -> None:
    spec, batch = history(band_tpot=False)
    # spec's worker-wide fit learned the long code prompts divided by their prior factor
    # (0.75 for speculation on a copy domain): 9 / 0.75 = 12 ms; a short translation bucket
    # starts from it x 0.85 (declared): 10.1 ms, so batch's 6.05 ms looked better
    assert tpot_ms(spec, "translation", 200) == pytest.approx(10.07, rel=0.01)
    assert tpot_ms(batch, "translation", 200) == pytest.approx(6.05, rel=0.01)


def test_once_the_band_has_samples_a_new_bucket_starts_from_the_band_fit() -> None:
    new, _ = history(band_tpot=True)
    old, _ = history(band_tpot=False)
    for prof in (new, old):
        for _ in range(10):
            prof.observe("extraction", 150, 0, 1, 0, 0.02, 0.0015, step_ratio=1.0)
    # band 0's fit: extraction's 1.5 ms over its prior factor 0.85 x 0.75 is 2.35 ms for a
    # chat-like shape, x 0.85 for translation: 2.0 ms, reached to within 10 % (2.21 ms);
    # the worker-wide fit, 30 long samples and 10 short ones, still starts it at 7.5 ms
    assert tpot_ms(new, "translation", 200) == pytest.approx(2.21, rel=0.02)
    assert tpot_ms(old, "translation", 200) == pytest.approx(7.51, rel=0.02)
    assert set(new.snapshot()["band_tpot_coef"]) == {"0", "2"}  # type: ignore[call-overload]


def test_before_any_band_sample_the_start_is_the_fleets_calibration() -> None:
    cal = Calibration()
    prof = WorkerProfile(LatencyPrior(SPEC, PriorConfig()), calibration=cal)
    # nothing measured anywhere: the prior, 22 ms x 0.85 (declared translation) = 18.7 ms
    assert tpot_ms(prof, "translation", 200) == pytest.approx(18.7, rel=1e-6)
    cal.observe("tpot", 0.011, 0.022)  # a long prompt elsewhere: every band's factor 0.5
    assert tpot_ms(prof, "translation", 200) == pytest.approx(9.35, rel=1e-6)
    cal.observe("tpot/0", 0.0044, 0.022)  # a short prompt elsewhere: band 0's own, 0.2
    assert tpot_ms(prof, "translation", 200) == pytest.approx(3.74, rel=1e-6)


def outcome(worker: str, shape: RequestShape, tpot_s: float) -> RequestOutcome:
    return RequestOutcome(worker, shape, "ok", completion_tokens=64, ttft_s=0.05,
                          tpot_s=tpot_s, e2e_s=0.05 + 63 * tpot_s, spec_depth=0, batch_size=0)


@pytest.mark.parametrize(("by_band", "expected"), [(True, "spec"), (False, "batch")])
def test_the_policy_sends_a_short_tight_request_to_spec_after_long_prompts_there(
        by_band: bool, expected: str) -> None:
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None, tpot_prior_by_band=by_band,
                                           interference=False, reserve_slots=False))
    views = [WorkerView("spec", "x", "engine", SPEC), WorkerView("batch", "x", "engine", BATCH)]
    for i in range(20):
        short = RequestShape("math", 200, None, 64)
        policy.choose(short, [views[1]])
        policy.observe(outcome("batch", short, 0.0046))
        long = RequestShape("code", 1500 + i, None, 64)
        policy.choose(long, [views[0]])
        policy.observe(outcome("spec", long, 0.009))
    tight = RequestShape("translation", 200, None, 64, slo_ttft_s=0.15, slo_tpot_s=0.0029)
    assert policy.choose(tight, views).worker == expected


def test_bad_samples_leave_the_band_fits_alone_and_the_snapshot_is_json() -> None:
    import orjson

    spec, _ = history(band_tpot=True)
    before = spec.snapshot()
    for bad in (float("nan"), float("inf"), -0.001, 0.0, None):
        spec.observe("extraction", 150, 0, 1, 0, 0.02, bad, step_ratio=1.0)
    after = spec.snapshot()
    assert after["band_tpot_coef"] == before["band_tpot_coef"]
    assert tpot_ms(spec, "code", 1500) == pytest.approx(8.89, rel=0.01)
    assert orjson.loads(orjson.dumps(after)) == after


def test_the_batch_slope_still_comes_from_the_worker_wide_fit() -> None:
    new, _ = history(band_tpot=True)
    old, _ = history(band_tpot=False)
    # the same samples reach the worker-wide fit either way: the crowding slope is unchanged
    assert new.tpot_per_seq_s() == old.tpot_per_seq_s()
    assert new.snapshot()["tpot_coef"] == old.snapshot()["tpot_coef"]
