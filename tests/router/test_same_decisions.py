"""The adaptive policy's cheaper per-request paths decide as the plain formulas would.

Each written-out path against the plain formula, on random inputs (bit-for-bit: the same
arithmetic in the same order), and a seeded simulator run against recorded decisions. The
RLS update against numpy's formulas is in test_sym3.py. bench/router_cost.py compares whole
trees (``--baseline REV``).
"""

from __future__ import annotations

import copy
import math
import random
from collections import Counter

import numpy as np

from bench.sim import prefix_mix_sim as pm
from polyinfer.config import CompiledConfig, DeclaredFit
from router.adaptive import AdaptiveConfig, AdaptivePolicy, Candidate
from router.calibration import Calibration
from router.confidence import MAX_LOG_ERROR, PredictionErrors
from router.inflight import STALE_FACTOR, Flight, InFlight
from router.profiles import (
    OUTLIER_FACTOR,
    PROMPT_BANDS,
    TPOT_KEY,
    BayesianRLS,
    LatencyPrior,
    Prediction,
    PriorConfig,
    WorkerProfile,
    _downdate,
    batch_capacity,
    prompt_band,
    tpot_features,
    ttft_features,
    uncached,
)
from router.sym3 import Mat3, clip_eigenvalues, eigvec
from specdec.policy import (
    NGRAM_DOMAIN_PRIORS,
    DepthPolicy,
    PolicyConfig,
    batch_tokens_per_step,
    depth_token_times,
)


def _random_flight(rng: random.Random, worker: str = "w", sent_s: float | None = None
                   ) -> Flight:
    slo_ttft = rng.choice((None, 0.0, rng.uniform(0.05, 1.0)))
    slo_tpot = rng.choice((None, 0.0, rng.uniform(0.001, 0.03)))
    return Flight(worker, rng.randint(0, 40), rng.randint(1, 32), rng.randint(0, 4),
                  rng.uniform(0, 10) if sent_s is None else sent_s, rng.uniform(0.001, 1.5),
                  rng.choice((rng.uniform(0.0005, 0.04), rng.uniform(0, 2e-4))),
                  rng.randint(1, 300), rng.uniform(0, 0.3),
                  slo_ttft, slo_tpot, rng.uniform(1, 5))


def _old_flight_cost(p: AdaptivePolicy, f: Flight, delay_s: float) -> float:
    cost_s = f.ttft_s + max(f.num_tokens - 1, 0) * f.tpot_s
    tpot_s = f.tpot_s + delay_s / max(f.num_tokens - 1, 1)
    penalty, _ = p._slo_of(f.slo_ttft_s, f.slo_tpot_s, f.ttft_s, tpot_s)
    return (cost_s + delay_s) * penalty


def test_flight_cost_s_is_the_plain_formula_bit_for_bit() -> None:
    rng = random.Random(1)
    for _ in range(5000):
        f = _random_flight(rng)
        assert f.cost_s == f.ttft_s + max(f.num_tokens - 1, 0) * f.tpot_s


def _populated(rng: random.Random, now: float) -> InFlight:
    flights = InFlight(10_000)
    for key in range(300):
        flights.add(key, _random_flight(rng, rng.choice("ab"), now - rng.uniform(0, 3)))
    return flights


def test_interference_is_the_old_loop_bit_for_bit() -> None:
    rng = random.Random(2)
    for trial in range(80):
        p, now = AdaptivePolicy(), 10.0
        p._inflight = _populated(rng, now)
        prefill = rng.choice((0.0, rng.uniform(0, 0.3)))
        cost = rng.choice((rng.uniform(0.01, 2), rng.uniform(0, 0.01)))
        crowd_s = rng.choice((0.0, rng.uniform(0, 1e-3)))
        old = 0.0
        if prefill > 0 or crowd_s > 0:
            for f in p._inflight.active("a", now):
                shared = min(max(f.sent_s + f.cost_s - now, 0.1 * f.cost_s), cost)
                delay = prefill + crowd_s * shared / max(f.tpot_s, 1e-4)
                old += _old_flight_cost(p, f, delay) - f.cost_s * f.penalty
        assert p._interference("a", now, prefill, crowd_s, cost) == old, trial
        # the candidate's one pass: the slot wait, the prefill ahead and this, together
        active = list(p._inflight.active("a", now))
        ahead = 1 + trial % 40
        left = sorted(max(f.sent_s + f.cost_s - now, 0.1 * f.cost_s) for f in active)
        wait = left[ahead - 1] if ahead <= len(left) else \
            left[-1] + (ahead - len(left)) / 8 * sum(f.cost_s for f in active) / len(active)
        prefilling = 0.0  # a loop, as the code sums (sum() compensates from Python 3.12)
        for f in active:
            if now < f.sent_s + f.ttft_s:
                prefilling += min(f.prefill_s, f.sent_s + f.ttft_s - now)
        assert p._inflight.load_terms("a", now, ahead, 8, 0.5, prefill, crowd_s, cost,
                                      p.config.slo_penalty) == (wait, prefilling, old), trial


def test_prefill_ahead_and_activity_are_the_old_scans() -> None:
    rng = random.Random(3)
    for now in (9.0, 10.0, 11.5):
        flights = _populated(rng, 10.0)
        for worker in "ab":
            every = list(flights._by_worker[worker].values())
            active = [f for f in every
                      if now < f.sent_s + STALE_FACTOR * max(f.cost_s, 1e-3)]
            assert list(flights.active(worker, now)) == active
            old = 0.0  # a loop, as the code sums (sum() compensates from Python 3.12)
            for f in active:
                if now < f.sent_s + f.ttft_s:
                    old += min(f.prefill_s, f.sent_s + f.ttft_s - now)
            assert flights.prefill_ahead_s(worker, now) == old
            left = sorted(f.remaining_s(now) for f in active)
            for ahead in (1, len(left) // 2, len(left), len(left) + 7):
                want = left[ahead - 1] if ahead <= len(left) else \
                    left[-1] + (ahead - len(left)) / 8 * sum(f.cost_s for f in active) / len(active)
                assert flights.slot_wait_s(worker, now, ahead, 8, 0.5) == want


# recorded: prefix_mix(16 req/s, 240 requests, seed 1, tight), the default adaptive policy
# on the simulated bench fleet, by the cost model alone (confidence=None). Re-recorded when
# the experiment switches were deleted (the slot reserve, the stall pricing, the band TPOT
# prior, the measured-step batch scaling, exploring within the SLO, the depth headroom):
# the first 6 decisions are as before.
RECORDED_FIRST = [("batch", 0, "fit"), ("spec", 3, "fit"), ("long", 0, "load"),
                  ("spec", 2, "fit"), ("long", 0, "load"), ("batch", 0, "fit"),
                  ("batch", 0, "load"), ("batch", 0, "fit"), ("long", 0, "load"),
                  ("batch", 0, "fit"), ("long", 0, "fit"), ("spec", 0, "load")]
RECORDED_COUNTS = {
    ("batch", 0, "explore"): 1, ("batch", 0, "fit"): 31, ("batch", 0, "load"): 32,
    ("batch", 0, "slo"): 8, ("long", 0, "affinity"): 2, ("long", 0, "explore"): 6,
    ("long", 0, "fit"): 37, ("long", 0, "load"): 25, ("long", 0, "slo"): 1,
    ("spec", 0, "affinity"): 2, ("spec", 0, "fit"): 57, ("spec", 0, "load"): 27,
    ("spec", 0, "slo"): 3, ("spec", 2, "fit"): 1, ("spec", 2, "load"): 1,
    ("spec", 2, "slo"): 1, ("spec", 3, "fit"): 2, ("spec", 3, "load"): 3}


def test_simulated_decisions_match_the_recorded_ones() -> None:
    """A changed count here is a changed decision: find it and explain it (a near-tie
    moved by rounding) before re-recording."""
    log: list[tuple[str, int | None, str]] = []

    def make(clock: pm.SimClock) -> AdaptivePolicy:
        policy = AdaptivePolicy(AdaptiveConfig(confidence=None), clock=clock)
        choose = policy.choose

        def recording(shape, workers):  # type: ignore[no-untyped-def]
            d = choose(shape, workers)
            log.append((d.worker, d.spec_depth, d.reason))
            return d
        policy.choose = recording  # type: ignore[method-assign]
        return policy

    pm.run_results(make, pm.prefix_mix(16.0, 240, 1, tight=True))
    assert log[:len(RECORDED_FIRST)] == RECORDED_FIRST
    assert dict(Counter(log)) == RECORDED_COUNTS


def _old_predict(prof: WorkerProfile, domain: str, prompt_tokens: int, queue: float,
                 batch: float, depth: int, cached_tokens: float = 0.0) -> Prediction:
    """WorkerProfile.predict as the plain formula: features, min / max, f-string keys."""
    cap = batch_capacity(prof.prior.config)
    new_tokens = uncached(prompt_tokens, cached_tokens)
    xt = ttft_features(new_tokens, min(queue, cap))
    xp = tpot_features(min(batch, cap), depth)
    bucket = prof._buckets.get((domain, prompt_band(prompt_tokens)))
    if bucket is None:
        f = prof.prior.factor(domain, prompt_tokens)
        spec = prof.prior.tpot_coef(domain)[0] / prof.prior.tpot_coef("chat")[0]
        t, p = prof._all.ttft.coef, prof._all.tpot.coef
        fs = f * spec
        ct, cp = (t[0] * f, t[1] * f, t[2] * f), (p[0] * fs, p[1] * fs, p[2] * fs)
        n = 0
    else:
        ct, cp, n = bucket.ttft.coef, bucket.tpot.coef, bucket.tpot.num_samples
    floor_ttft = 0.1 * ct[0] if ct[0] > 0 else 1e-4
    ttft = max(ct[0] + ct[1] * xt[1] + ct[2] * xt[2], floor_ttft, 1e-4)
    tpot = max(cp[0] + cp[1] * xp[1] + cp[2] * xp[2], 1e-5)
    prefill = max(ct[1] * xt[1], 0.0)
    if prof._all.ttft.num_samples == 0:
        c = prof.calibration.factor(f"ttft/{prompt_band(new_tokens)}")
        ttft, prefill = ttft * c, prefill * c
    if prof._all.tpot.num_samples == 0:
        tpot *= prof.calibration.factor(TPOT_KEY)
    return Prediction(ttft, tpot, n, prefill)


def _random_profile(rng: random.Random) -> WorkerProfile:
    fit = rng.choice((DeclaredFit(), DeclaredFit(domains=("code", "chat"), prompt_tokens=(0, 600))))
    cfg = CompiledConfig(fit=fit).with_engine(
        max_num_seqs=rng.choice((1, 4, 32)), max_num_batched_tokens=rng.choice((256, 2048)),
        spec_method=rng.choice(("none", "ngram")), spec_max_depth=4)
    return WorkerProfile(LatencyPrior(cfg, PriorConfig()), 0.98, Calibration())


def _random_request(rng: random.Random) -> tuple[str, int, float, float, int, float]:
    return (rng.choice(("code", "chat", "rag")), rng.choice((1, 100, 255, 256, 599, 600, 5000)),
            rng.choice((0, 1, 3, 40, 2.5)), rng.choice((1, 2, 4, 33, 7.5)), rng.randint(0, 4),
            rng.choice((0.0, 0.0, 50.0, 99.5, 10_000.0)))


def test_predict_is_the_plain_formula_bit_for_bit() -> None:
    """Before and after samples (so the calibrated prior, then the fits), with and without
    buckets of their own, cached prefixes, loads past the capacity."""
    rng = random.Random(4)
    for trial in range(40):
        prof = _random_profile(rng)
        for step in range(60):
            req = _random_request(rng)
            assert prof.predict(*req) == _old_predict(prof, *req), (trial, step, req)
            coef = prof.coefficients(req[0], req[1])
            assert prof.predict_at(coef, req[2], req[3], req[4], req[1], req[5]) \
                == _old_predict(prof, *req)
            # a candidate's loaded, idle and uncached predictions in one call
            loaded, idle = _old_predict(prof, *req), _old_predict(prof, req[0], req[1], 0, 1,
                                                                  req[4], req[5])
            full = _old_predict(prof, *req[:5])
            assert loaded.prefill_s == idle.prefill_s
            assert prof.predict_candidate(*req) == (
                loaded.ttft_s, loaded.tpot_s, loaded.prefill_s, idle.ttft_s, idle.tpot_s,
                full.ttft_s)
            if rng.random() < 0.3:
                obs = _random_request(rng)
                prof.observe(*obs[:5], rng.choice((None, rng.uniform(0.001, 2.0))),
                             rng.choice((None, rng.uniform(1e-4, 0.1))), obs[5])
            if rng.random() < 0.1:
                prof.calibration.observe(rng.choice((TPOT_KEY, "ttft/0", "ttft/2")),
                                         rng.uniform(0.01, 1), rng.uniform(0.01, 1))


def _old_eigvec(a: Mat3, lam: float) -> tuple[float, float, float] | None:
    """router.sym3.eigvec as the plain loop over the three rows' cross products."""
    (a00, a01, a02), (_, a11, a12), (_, _, a22) = a
    r0, r1, r2 = (a00 - lam, a01, a02), (a01, a11 - lam, a12), (a02, a12, a22 - lam)
    best, best_n = (0.0, 0.0, 0.0), 0.0
    for u, v in ((r0, r1), (r0, r2), (r1, r2)):
        c = (u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0])
        n = c[0] * c[0] + c[1] * c[1] + c[2] * c[2]
        if n > best_n:
            best, best_n = c, n

    def dot(x: tuple[float, ...], y: tuple[float, ...]) -> float:
        return x[0] * y[0] + x[1] * y[1] + x[2] * y[2]
    scale = dot(r0, r0) + dot(r1, r1) + dot(r2, r2)
    if best_n <= 1e-12 * scale * scale or best_n == 0.0:
        return None
    s = 1.0 / math.sqrt(best_n)
    return best[0] * s, best[1] * s, best[2] * s


def test_eigvec_is_the_plain_loop_bit_for_bit() -> None:
    rng = random.Random(5)
    for trial in range(20_000):
        vals = [rng.choice((0.0, 1.0, rng.gauss(0, 1), rng.gauss(0, 1e-6))) for _ in range(6)]
        a = ((vals[0], vals[1], vals[2]), (vals[1], vals[3], vals[4]),
             (vals[2], vals[4], vals[5]))
        lam = rng.choice((0.0, vals[0], rng.gauss(0, 1)))
        assert eigvec(a, lam) == _old_eigvec(a, lam), (trial, a, lam)


def _old_update(rls: BayesianRLS, x: tuple[float, float, float], y: float
                ) -> tuple[tuple[float, float, float], Mat3]:
    """(theta, P) after BayesianRLS.update as the plain formula, with its dot-product
    helper calls."""
    def dot(a: tuple[float, ...], b: tuple[float, ...]) -> float:
        return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
    p, lam = rls._p, rls.forgetting
    px = (dot(p[0], x), dot(p[1], x), dot(p[2], x))
    denom = lam + dot(x, px)
    gain = (px[0] / denom, px[1] / denom, px[2] / denom)
    pred = dot(x, rls.theta)
    target = y / rls.scale
    if pred > 0:
        target = min(max(target, pred / OUTLIER_FACTOR), pred * OUTLIER_FACTOR)
    err = target - pred
    t = rls.theta
    theta = (t[0] + gain[0] * err, t[1] + gain[1] * err, t[2] + gain[2] * err)
    sym = _downdate(p, gain, px, lam)
    capped = clip_eigenvalues(sym, rls._p_cap)
    if capped is None:
        eig, vec = np.linalg.eigh(np.array(sym))
        full = (vec * np.clip(eig, 0.0, rls._p_cap)) @ vec.T
        capped = tuple(tuple(float(v) for v in row) for row in full)  # type: ignore[assignment]
    assert capped is not None
    return theta, capped


def test_rls_update_is_the_plain_formula_bit_for_bit() -> None:
    rng = random.Random(6)
    for trial in range(200):
        rls = BayesianRLS((rng.uniform(1e-3, 0.05), rng.uniform(0, 0.1), rng.uniform(0, 0.2)),
                          1.0, rng.choice((0.98, 1.0)))
        for step in range(50):
            x = (1.0, rng.choice((0.1, 0.5, rng.uniform(0, 5))), rng.choice((0.0, 0.25, 1.0)))
            y = rng.choice((rng.uniform(1e-3, 0.2), rng.uniform(1, 5)))
            want = _old_update(rls, x, y)
            rls.update(x, y)
            assert (rls.theta, rls._p) == want, (trial, step)


def _old_peek_times(dp: DepthPolicy, worker: str, domain: str, batch: int, max_depth: int,
                    calibrated: bool) -> list[float]:
    """DepthPolicy.peek's times as the plain formulas: batch_tokens_per_step of the worker's
    mix, then depth_token_times."""
    c = dp.config
    cap = min(max_depth, c.max_depth)
    est = dp.acceptance(worker, domain)
    steps = c.prior_steps_per_depth
    expected = est.tokens_per_step(cap, steps)
    drafted = est.drafts_per_step(cap, steps)
    if batch > 1:
        ests = [(w, dp.acceptance(worker, d)) for d, w in dp._mix.get(worker, {}).items()]
        expected = batch_tokens_per_step(
            expected, [(w, e.tokens_per_step(cap, steps)) for w, e in ests], batch)
        drafted = batch_tokens_per_step(
            drafted, [(w, e.drafts_per_step(cap, steps)) for w, e in ests], batch)
    return depth_token_times(est.mean, max(batch, 1), dp.step_time(worker), cap, expected,
                             drafted, calibrated)


def test_depth_peek_is_the_plain_formulas_bit_for_bit() -> None:
    """Its kept mix sums and step terms through commits, observed requests and engine step
    feeds (each invalidates some of them), at batches below and past the worker's."""
    rng = random.Random(7)
    domains = ("code", "chat", "rag", "translation")
    for trial in range(6):
        dp = DepthPolicy(PolicyConfig(domain_priors=NGRAM_DOMAIN_PRIORS))
        for step in range(150):
            worker, domain = rng.choice("ab"), rng.choice(domains)
            batch, cap = rng.choice((1, 1, 2, 4, 9, 33)), rng.choice((2, 4, 6))
            k = 0
            # a few fixed keys after every change (a kept term must follow each), and this one
            for w, b, m, cal in [(w, b, 4, cal) for w in "ab" for b in (1, 4) for cal in (1, 0)] \
                    + [(worker, batch, cap, rng.random() < 0.8)]:
                want = _old_peek_times(dp, w, domain, b, m, bool(cal))
                assert dp.peek_times(w, domain, b, m, bool(cal)) == want, (trial, step)
                k = dp.peek(w, domain, b, m, bool(cal))
                best_k, best = 0, dp.config.min_gain / want[0]  # choose_depth's argmax
                for j in range(1, m + 1):
                    if 1.0 / want[j] > best:
                        best_k, best = j, 1.0 / want[j]
                assert k == best_k, (trial, step)
            for w in "ab":  # the kept calibration ratios against a model without them
                fresh = copy.deepcopy(dp.step_time(w))
                fresh._ratios.clear()
                fresh._calibrated.clear()
                for b in (1, 4, 33):
                    assert dp.step_time(w).calibrations(b, 4) == fresh.calibrations(b, 4)
            r = rng.random()
            if r < 0.4:
                dp.commit(worker, domain, batch, k, cap)
            elif r < 0.75:
                depth = rng.choice((0, k, 2))
                n = rng.randint(2, 120)
                dp.observe_request(worker, domain, batch, depth, depth * n // 3, n // 4, n,
                                   rng.uniform(0.01, 2.0))
            elif r < 0.8:  # a client's step alone: once fed, the wait per step moves
                dp.observe_step(worker, batch, rng.choice((0, 2)), rng.uniform(0.005, 0.05))
            elif r < 0.85:
                x = [[rng.uniform(0, 1) * (i == j) + 0.01 for j in range(7)] for i in range(7)]
                dp.observe_step_sums(worker, x, [rng.uniform(0, 0.1) for _ in range(7)],
                                     rng.randint(1, 50), rng.uniform(0, 300))


def _old_profile_observe(prof: WorkerProfile, domain: str, prompt_tokens: int, queue: float,
                         batch: float, depth: int, ttft_s: float | None, tpot_s: float | None,
                         cached_tokens: float = 0.0) -> None:
    """WorkerProfile.observe as the plain formula: the prior's ttft_s / tpot_s called."""
    has_ttft = ttft_s is not None and ttft_s >= 0 and math.isfinite(ttft_s)
    has_tpot = tpot_s is not None and tpot_s > 0 and math.isfinite(tpot_s)
    if has_tpot and prof._all.tpot.num_samples == 0:
        prof._all.tpot.rescale(prof.calibration.factor(TPOT_KEY))
    key = (domain, prompt_band(prompt_tokens))
    if key not in prof._buckets:
        prof._buckets[key] = prof._bucket_init(domain, prompt_tokens)
    bucket, cap = prof._buckets[key], prof._cap
    new_tokens = uncached(prompt_tokens, cached_tokens)
    xt = ttft_features(new_tokens, min(queue, cap))
    xp = tpot_features(min(batch, cap), depth)
    f = prof.prior.factor(domain, prompt_tokens)
    spec = prof.prior.tpot_coef(domain)[0] / prof.prior.tpot_coef("chat")[0]
    if has_ttft:
        bucket.ttft.update(xt, ttft_s)
        prof._all.ttft.update(xt, ttft_s / f)
        prof.calibration.observe(f"ttft/{prompt_band(new_tokens)}", ttft_s,
                                 prof.prior.ttft_s(domain, new_tokens, min(queue, cap)))
    if has_tpot:
        bucket.tpot.update(xp, tpot_s)
        prof._all.tpot.update(xp, tpot_s / (f * spec))
        prof.calibration.observe(TPOT_KEY, tpot_s,
                                 prof.prior.tpot_s(domain, prompt_tokens, batch, depth))


def _profile_state(prof: WorkerProfile) -> tuple:
    models = [prof._all.ttft, prof._all.tpot] + [
        m for b in prof._buckets.values() for m in (b.ttft, b.tpot)]
    return ([(m.theta, m._p, m.num_samples) for m in models], prof.calibration._log,
            prof.calibration._num, sorted(prof._buckets))


def test_profile_observe_is_the_plain_formula_bit_for_bit() -> None:
    rng = random.Random(8)
    for trial in range(30):
        a = _random_profile(rng)
        b = WorkerProfile(LatencyPrior(a.prior.config, PriorConfig()), 0.98, Calibration())
        for step in range(40):
            req = _random_request(rng)
            ttft = rng.choice((None, -1.0, rng.uniform(0.001, 2.0)))
            tpot = rng.choice((None, 0.0, rng.uniform(1e-4, 0.1)))
            a.observe(*req[:5], ttft, tpot, req[5])
            _old_profile_observe(b, *req[:5], ttft, tpot, req[5])
            assert _profile_state(a) == _profile_state(b), (trial, step)


def test_prediction_errors_are_the_plain_formula_bit_for_bit() -> None:
    """PredictionErrors.observe against its running means as the plain formulas (max, min)."""
    rng = random.Random(9)
    errors, want = PredictionErrors(), {}
    for _ in range(3000):
        worker, domain = rng.choice("ab"), rng.choice(("code", "chat"))
        tokens = rng.choice((10, 300, 5000))
        predicted = (rng.uniform(1e-3, 1.0), rng.uniform(1e-4, 0.05))
        observed = (rng.choice((None, 0.0, rng.uniform(1e-3, 1.0), 1e9)),
                    rng.choice((None, rng.uniform(1e-4, 0.05))))
        n_tok = rng.randint(0, 300)
        errors.observe(worker, domain, tokens, predicted, observed, n_tok)
        def log_error(p: float, o: float | None) -> float | None:
            if o is None or not (p > 0 and o > 0) or not math.isfinite(math.log(o / p)):
                return None
            return min(max(math.log(o / p), -MAX_LOG_ERROR), MAX_LOG_ERROR)
        xs = [log_error(p, o) for p, o in zip(predicted, observed, strict=True)]
        gaps = max(n_tok - 1, 0)
        xs.append(None if observed[0] is None or observed[1] is None else log_error(
            predicted[0] + gaps * predicted[1], observed[0] + gaps * observed[1]))
        for key in ((worker, domain, prompt_band(tokens)), worker):
            e = want.setdefault(key, [0, 0.0, 0.0, 0, 0.0, 0.0, 0, 0.0])
            for i, x in zip((0, 3), xs[:2], strict=True):
                if x is not None:
                    e[i] += 1
                    w = max(1.0 / e[i], 0.05)
                    e[i + 1] += w * (x * x - e[i + 1])
                    e[i + 2] += w * (x - e[i + 2])
            if xs[2] is not None:
                e[6] += 1
                e[7] += max(1.0 / e[6], 0.05) * (xs[2] * xs[2] - e[7])
    got = {**{k: v for k, v in errors._errors.items()}, **errors._by_worker}
    assert set(got) == set(want)
    for key, e in got.items():
        assert [e.num_ttft, e.ttft_sq, e.ttft_bias, e.num_tpot, e.tpot_sq, e.tpot_bias,
                e.num_e2e, e.e2e_sq] == want[key], key


def test_prompt_band_is_the_plain_loop() -> None:
    def old(tokens: float) -> int:
        for i, edge in enumerate(PROMPT_BANDS):
            if tokens < edge:
                return i
        return len(PROMPT_BANDS)
    for tokens in [*range(0, 5000), 255.5, 256.0, 1e9, -3, math.nan, math.inf]:
        assert prompt_band(tokens) == old(tokens), tokens  # type: ignore[arg-type]


def _old_pick(p: AdaptivePolicy, cands: list[Candidate]) -> tuple[Candidate, str]:
    if len(cands) == 1:
        return cands[0], "only"
    best = min(cands, key=lambda c: c.cost_s)
    open_ = [c for c in cands if not c.saturated]
    if open_ and p._rng.random() < p.config.explore_prob:
        return p._rng.choice(open_), "explore"
    if best.saved_s > 0 and min(cands, key=lambda c: c.cost_s + c.saved_s) is not best:
        return best, "affinity"
    favourite = min(cands, key=lambda c: c.unloaded_cost_s)
    if best.name == favourite.name:
        return best, "fit"
    return best, ("slo" if not favourite.meets_slo and best.meets_slo else "load")


def test_pick_is_the_plain_formula() -> None:
    """Ties (the first of the least wins), saturated workers, exploration's draws."""
    rng = random.Random(10)
    new, old = AdaptivePolicy(AdaptiveConfig(explore_prob=0.2), seed=3), \
        AdaptivePolicy(AdaptiveConfig(explore_prob=0.2), seed=3)
    for _ in range(3000):
        cands = [Candidate(f"w{i}", rng.choice((1.0, 2.0, rng.uniform(0, 3))),
                           rng.choice((1.0, rng.uniform(0, 3))), None, 0, 1,
                           rng.random() < 0.4, rng.random() < 0.5,
                           saved_s=rng.choice((0.0, rng.uniform(0, 2))))
                 for i in range(rng.randint(1, 4))]
        got, want = new._pick(cands), _old_pick(old, cands)
        assert got[0] is want[0] and got[1] == want[1]
