"""Per-worker latency profiles, learned online from finished requests.

Two linear models per (worker, shape bucket):

- TTFT (seconds) against ``[1, prompt_tokens / 1000, queue / 8]``, where
  ``prompt_tokens`` are those the worker must prefill (the prompt less what its prefix
  cache is expected to hold, :mod:`router.affinity`) and
  ``queue`` is the worker's load when the request was sent, up to its batch
  capacity (the requests it shares steps with; the wait for a slot past the
  capacity is the policy's, from what is ahead: :mod:`router.inflight`);
- TPOT (seconds per output token) against ``[1, batch / 8, k / 4]`` — batch
  size and speculative depth.

Each is Bayesian linear regression solved by recursive least squares with
forgetting, whose *prior mean* is the coefficient vector that
:class:`LatencyPrior` derives from the worker's compiled config and declared
fit, and whose prior variance is ``prior_variance`` (relative to the noise,
in units of the prior's own intercept). So a new worker predicts what its
config says, each sample moves the fit only as far as the evidence goes, and
a slope that the traffic never exercises (queue always 0, say) stays at the
prior's value instead of drifting anywhere. Old samples fade with the
forgetting factor, so a re-tuned worker is re-learned.

A shape bucket is ``(domain, prompt-length band)``. A bucket's TTFT model starts
from the worker-level models' current fits (scaled by the bucket's prior factors),
so one bucket's evidence informs the others until they have their own. The
worker-level TPOT fit also gives the batch slope
(:meth:`WorkerProfile.tpot_per_seq_s`). A predict is a 3-term dot product; an
update ~6 us on the 2-core dev box (plain floats, the eigenvalue cap in closed form:
:mod:`router.sym3`; numpy's calls on 3-vectors made it ~40 us).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from polyinfer.config import CompiledConfig, DeclaredFit
from router.calibration import Calibration
from router.sym3 import _DEGENERATE, Mat3, clip_eigenvalues

PROMPT_BANDS = (256, 1024, 4096)  # bucket upper edges, tokens; last band is open
Vec = tuple[float, float, float]
OUTLIER_FACTOR = 4.0  # one sample counts as at most this many times the current prediction
_TWO_THIRDS_PI = 2.0 * math.pi / 3.0  # as router.sym3.eigvals computes it


TPOT_KEY = "tpot"  # calibration keys (router.calibration): TPOT, and TTFT per prompt band


def ttft_key(prompt_tokens: int) -> str:
    return _TTFT_KEYS[prompt_band(prompt_tokens)]


def batch_capacity(config: CompiledConfig) -> int:
    """Sequences the worker runs at once: ``max_num_seqs`` per engine core."""
    return config.engine.max_num_seqs * max(config.engine.data_parallel_size, 1)


def uncached(prompt_tokens: int, cached_tokens: float) -> int:
    """Prompt tokens left to prefill when ``cached_tokens`` are found in the prefix cache;
    at least one (an engine recomputes the last prompt token to sample the first output)."""
    return max(prompt_tokens - int(cached_tokens), 1) if cached_tokens > 0 else prompt_tokens


def _downdate(p: Mat3, gain: Vec, px: Vec, lam: float) -> Mat3:
    """(P - gain px^T) / lam, symmetrised: 0.5 (M + M^T)."""
    (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = p
    g0, g1, g2 = gain
    x0, x1, x2 = px
    d01, d10 = (p01 - g0 * x1) / lam, (p10 - g1 * x0) / lam
    d02, d20 = (p02 - g0 * x2) / lam, (p20 - g2 * x0) / lam
    d12, d21 = (p12 - g1 * x2) / lam, (p21 - g2 * x1) / lam
    s01, s02, s12 = 0.5 * (d01 + d10), 0.5 * (d02 + d20), 0.5 * (d12 + d21)
    return (((p00 - g0 * x0) / lam, s01, s02),
            (s01, (p11 - g1 * x1) / lam, s12),
            (s02, s12, (p22 - g2 * x2) / lam))


def prompt_band(prompt_tokens: int) -> int:
    """The index of the first band edge above ``prompt_tokens`` (len(PROMPT_BANDS) past the
    last): the edges at or below it, counted in C (this runs ~7 times per request)."""
    return bisect_right(PROMPT_BANDS, prompt_tokens)


_TTFT_KEYS = tuple(f"ttft/{band}" for band in range(len(PROMPT_BANDS) + 1))


def ttft_features(prompt_tokens: int, queue: float) -> Vec:
    return (1.0, prompt_tokens / 1000.0, queue / 8.0)


def tpot_features(batch: float, depth: int) -> Vec:
    return (1.0, batch / 8.0, depth / 4.0)


class BayesianRLS:
    """Online ridge regression toward a prior mean, with exponential forgetting.

    Targets are divided by ``scale`` (the prior's intercept) so that one prior
    variance fits models whose outputs differ by orders of magnitude.
    """

    def __init__(self, prior_mean: Vec, prior_variance: float = 1.0, forgetting: float = 0.98
                 ) -> None:
        self.scale = max(abs(prior_mean[0]), 1e-6)
        self.theta: Vec = (prior_mean[0] / self.scale, prior_mean[1] / self.scale,
                           prior_mean[2] / self.scale)
        v = prior_variance
        self._p: Mat3 = ((v, 0.0, 0.0), (0.0, v, 0.0), (0.0, 0.0, v))
        self.forgetting = forgetting
        self.num_samples = 0
        self._p_cap = prior_variance
        self._w = self._weights()

    @property
    def p(self) -> np.ndarray:
        """The coefficients' covariance (relative to the noise), [3, 3]."""
        return np.array(self._p)

    def _weights(self) -> Vec:
        t, s = self.theta, self.scale
        return (t[0] * s, t[1] * s, t[2] * s)

    def update(self, x: Vec, y: float) -> None:
        # NOTE: plain floats, not numpy: on 3-vectors numpy's per-call overhead was most of
        # the cost of an update, which runs four times per finished request. And one
        # function: the downdate (_downdate), the eigenvalues (router.sym3.eigvals), the cap
        # (router.sym3.clip_eigenvalues) and its eigenvector (router.sym3.eigvec) written out
        # on locals, the same operations in the same order (each dot product summed left to
        # right), so theta and P are theirs bit for bit (tests/router/test_same_decisions.py);
        # the calls and tuples between them were ~40% of an update.
        lam = self.forgetting
        x0, x1, x2 = x
        (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = self._p
        px0 = p00 * x0 + p01 * x1 + p02 * x2
        px1 = p10 * x0 + p11 * x1 + p12 * x2
        px2 = p20 * x0 + p21 * x1 + p22 * x2
        denom = lam + (x0 * px0 + x1 * px1 + x2 * px2)
        g0, g1, g2 = px0 / denom, px1 / denom, px2 / denom
        t0, t1, t2 = self.theta
        pred = x0 * t0 + x1 * t1 + x2 * t2
        target = y / self.scale
        if pred > 0:
            # NOTE: latencies are heavy-tailed (a stall, a co-tenant); bound one sample's
            # pull to [pred / 4, 4 * pred] so a real shift is followed over a few samples
            # and a single outlier cannot swing the fit by orders of magnitude.
            bound = pred / OUTLIER_FACTOR  # min(max(target, pred / 4), pred * 4)
            if bound > target:
                target = bound
            bound = pred * OUTLIER_FACTOR
            if bound < target:
                target = bound
        err = target - pred
        t0, t1, t2 = t0 + g0 * err, t1 + g1 * err, t2 + g2 * err
        self.theta = (t0, t1, t2)
        # (P - gain px^T) / lam, symmetrised (_downdate)
        d01, d10 = (p01 - g0 * px1) / lam, (p10 - g1 * px0) / lam
        d02, d20 = (p02 - g0 * px2) / lam, (p20 - g2 * px0) / lam
        d12, d21 = (p12 - g1 * px2) / lam, (p21 - g2 * px1) / lam
        a01, a02, a12 = 0.5 * (d01 + d10), 0.5 * (d02 + d20), 0.5 * (d12 + d21)
        a00, a11, a22 = (p00 - g0 * px0) / lam, (p11 - g1 * px1) / lam, (p22 - g2 * px2) / lam
        # NOTE: forgetting inflates P along directions the data never excites; cap its
        # eigenvalues at the prior's variance so those slopes stay near the prior. The cap
        # must keep P positive semi-definite: an elementwise clip did not, and a TPOT fit
        # diverged to coefficients of +-2e10 in a routing bench run. Closed form
        # where it applies (router.sym3), eigh where it does not.
        cap = self._p_cap
        capped: Mat3 | None = None
        p1 = a01 * a01 + a02 * a02 + a12 * a12
        if p1 == 0.0:  # diagonal: rare, router.sym3 as is
            capped = clip_eigenvalues(((a00, a01, a02), (a01, a11, a12), (a02, a12, a22)), cap)
        else:
            q = (a00 + a11 + a22) / 3.0
            b00, b11, b22 = a00 - q, a11 - q, a22 - q
            p = math.sqrt((b00 * b00 + b11 * b11 + b22 * b22 + 2.0 * p1) / 6.0)
            det = (b00 * (b11 * b22 - a12 * a12) - a01 * (a01 * b22 - a12 * a02)
                   + a02 * (a01 * a12 - b11 * a02))
            r = det / (2.0 * p * p * p)  # min(max(r, -1), 1)
            if -1.0 > r:
                r = -1.0
            if 1.0 < r:
                r = 1.0
            phi = math.acos(r) / 3.0
            hi = q + 2.0 * p * math.cos(phi)
            lo = q + 2.0 * p * math.cos(phi + _TWO_THIRDS_PI)
            mid = 3.0 * q - hi - lo
            if lo < 0.0:
                pass  # eigh below
            elif hi <= cap:
                capped = ((a00, a01, a02), (a01, a11, a12), (a02, a12, a22))
            elif lo >= cap:
                capped = ((cap, 0.0, 0.0), (0.0, cap, 0.0), (0.0, 0.0, cap))
            else:
                one = mid <= cap  # one above the cap, else two
                ev = hi if one else lo
                # eigvec(A, ev): the rows' largest cross product
                b00, b11, b22 = a00 - ev, a11 - ev, a22 - ev
                c0, c1, c2 = a01 * a12 - a02 * b11, a02 * a01 - b00 * a12, b00 * b11 - a01 * a01
                best_n = c0 * c0 + c1 * c1 + c2 * c2
                if not best_n > 0.0:
                    c0 = c1 = c2 = best_n = 0.0
                d0, d1, d2 = a01 * b22 - a02 * a12, a02 * a02 - b00 * b22, b00 * a12 - a01 * a02
                n = d0 * d0 + d1 * d1 + d2 * d2
                if n > best_n:
                    c0, c1, c2, best_n = d0, d1, d2, n
                d0, d1, d2 = b11 * b22 - a12 * a12, a12 * a02 - a01 * b22, a01 * a12 - b11 * a02
                n = d0 * d0 + d1 * d1 + d2 * d2
                if n > best_n:
                    c0, c1, c2, best_n = d0, d1, d2, n
                scale = ((b00 * b00 + a01 * a01 + a02 * a02)
                         + (a01 * a01 + b11 * b11 + a12 * a12)
                         + (a02 * a02 + a12 * a12 + b22 * b22))
                if not (best_n <= _DEGENERATE * scale * scale or best_n == 0.0):
                    s = 1.0 / math.sqrt(best_n)
                    v0, v1, v2 = c0 * s, c1 * s, c2 * s
                    if one:  # A less its excess along v
                        e = hi - cap
                        m01, m02, m12 = a01 - e * v0 * v1, a02 - e * v0 * v2, a12 - e * v1 * v2
                        capped = ((a00 - e * v0 * v0, m01, m02), (m01, a11 - e * v1 * v1, m12),
                                  (m02, m12, a22 - e * v2 * v2))
                    else:  # cap I but along the lowest one's v
                        e = lo - cap
                        m01, m02, m12 = e * v0 * v1, e * v0 * v2, e * v1 * v2
                        capped = ((cap + e * v0 * v0, m01, m02), (m01, cap + e * v1 * v1, m12),
                                  (m02, m12, cap + e * v2 * v2))
        if capped is None:
            sym = np.array(((a00, a01, a02), (a01, a11, a12), (a02, a12, a22)))
            eig, vec = np.linalg.eigh(sym)
            full = (vec * np.clip(eig, 0.0, cap)) @ vec.T
            capped = tuple(tuple(float(v) for v in row) for row in full)  # type: ignore[assignment]
        self._p = capped  # type: ignore[assignment]
        self.num_samples += 1
        s = self.scale
        self._w = (t0 * s, t1 * s, t2 * s)

    def rescale(self, factor: float) -> None:
        """Multiply every coefficient (the fit's predictions) by ``factor``."""
        t = self.theta
        self.theta = (t[0] * factor, t[1] * factor, t[2] * factor)
        self._w = self._weights()

    @property
    def coef(self) -> Vec:
        return self._w

    def predict(self, x: Vec) -> float:
        w = self._w
        return w[0] * x[0] + w[1] * x[1] + w[2] * x[2]


@dataclass(frozen=True)
class PriorConfig:
    """The prior latency model, in seconds, before any measurement."""

    step_s: float = 0.02  # one decode step at batch 1
    step_per_seq_s: float = 0.002  # added per running sequence
    prefill_s_per_token: float = 0.0002
    spec_speedup: float = 0.75  # TPOT factor for speculating workers on copy-heavy domains
    copy_domains: tuple[str, ...] = ("code", "extraction", "summarization", "rag")
    fit_bonus: float = 0.85  # cost factor when the declared fit covers the shape
    prior_variance: float = 1.0  # coefficient variance, in units of the prior intercept

    def __post_init__(self) -> None:
        if min(self.step_s, self.prefill_s_per_token, self.prior_variance) <= 0:
            raise ValueError("step_s, prefill_s_per_token and prior_variance must be > 0")
        if not 0 < self.spec_speedup <= 1 or not 0 < self.fit_bonus <= 1:
            raise ValueError("spec_speedup and fit_bonus must be in (0, 1]")


class LatencyPrior:
    """TTFT/TPOT coefficient guesses from a compiled config: batch cap, prefill budget,
    speculation and declared fit."""

    def __init__(self, config: CompiledConfig, prior: PriorConfig) -> None:
        self.config = config
        self.prior = prior
        fit = config.fit
        # NOTE: the default fit (any domain, any length) declares nothing: no bonus.
        self._declared = bool(fit.domains) or fit.prompt_tokens != DeclaredFit().prompt_tokens
        # pure functions of the config, read at every finished request: computed once
        self._ttft_coef = self._ttft_coef_of()
        self._tpot_coef: dict[str, Vec] = {}
        self._cap = batch_capacity(config)

    def factor(self, domain: str, prompt_tokens: int) -> float:
        if self._declared and self.config.fit.covers(domain, prompt_tokens):
            return self.prior.fit_bonus
        return 1.0

    def ttft_coef(self) -> Vec:
        """[s, s per 1000 prompt tokens, s per 8 queued requests] for an average shape."""
        return self._ttft_coef

    def _ttft_coef_of(self) -> Vec:
        p, e = self.prior, self.config.engine
        per_k = 1000 * (p.prefill_s_per_token + p.step_s / e.max_num_batched_tokens)
        # a queued request ahead costs about one prefill step, shared by the engine cores;
        # past the batch cap a whole request's decode (the policy adds that wait separately)
        return (p.step_s, per_k, 8 * p.step_s / max(e.data_parallel_size, 1))

    def tpot_coef(self, domain: str) -> Vec:
        coef = self._tpot_coef.get(domain)
        if coef is None:
            p, e = self.prior, self.config.engine
            f = p.spec_speedup if e.spec_method != "none" and domain in p.copy_domains else 1.0
            coef = self._tpot_coef[domain] = (p.step_s * f, 8 * p.step_per_seq_s * f, 0.0)
        return coef

    def ttft_s(self, domain: str, prompt_tokens: int, queue: float) -> float:
        c = self.ttft_coef()
        x = ttft_features(prompt_tokens, queue)
        return (c[0] + c[1] * x[1] + c[2] * x[2]) * self.factor(domain, prompt_tokens)

    def tpot_s(self, domain: str, prompt_tokens: int, batch: float, depth: int) -> float:
        c = self.tpot_coef(domain)
        x = tpot_features(min(batch, self._cap), depth)
        return (c[0] + c[1] * x[1] + c[2] * x[2]) * self.factor(domain, prompt_tokens)


@dataclass
class _Models:
    ttft: BayesianRLS
    tpot: BayesianRLS


@dataclass(slots=True)
class Prediction:
    """Read-only by convention; not frozen, as :class:`router.adaptive.Candidate` (a
    routing decision builds several)."""

    ttft_s: float
    tpot_s: float
    num_samples: int  # samples of the request's own bucket behind it
    prefill_s: float = 0.0  # the prompt-length part of the TTFT: prefill compute, seconds


class WorkerProfile:
    """Learned TTFT/TPOT for one worker: a worker-level model and per-bucket models.

    Until the worker has samples of its own, its predictions are the prior scaled by
    ``calibration`` (shared with the other workers' profiles, :mod:`router.calibration`);
    its first sample starts the fit from there.
    """

    def __init__(self, prior: LatencyPrior, forgetting: float = 0.98,
                 calibration: Calibration | None = None) -> None:
        self.prior = prior
        self.calibration = calibration if calibration is not None else Calibration()
        self._forgetting = forgetting
        v = prior.prior.prior_variance
        self._all = _Models(BayesianRLS(prior.ttft_coef(), v, forgetting),
                            BayesianRLS(prior.tpot_coef("chat"), v, forgetting))
        self._buckets: dict[tuple[str, int], _Models] = {}
        # NOTE: pure functions of the prior (fixed for the profile's life), read at every
        # predict: the batch capacity, and per domain the prior's TPOT speculation ratio
        self._cap = batch_capacity(prior.config)
        self._spec: dict[str, float] = {}

    def _spec_ratio(self, domain: str) -> float:
        """The prior's TPOT at ``domain`` over its TPOT at chat (the speculation factor)."""
        spec = self._spec.get(domain)
        if spec is None:
            spec = self._spec[domain] = \
                self.prior.tpot_coef(domain)[0] / self.prior.tpot_coef("chat")[0]
        return spec

    def _bucket_coef(self, domain: str, prompt_tokens: int) -> tuple[Vec, Vec]:
        """A new bucket's (TTFT, TPOT) coefficients: the worker-level fits, shaped by the
        bucket's prior factors."""
        f = self.prior.factor(domain, prompt_tokens)
        spec = self._spec_ratio(domain)
        t, p = self._all.ttft.coef, self._all.tpot.coef
        fs = f * spec
        return (t[0] * f, t[1] * f, t[2] * f), (p[0] * fs, p[1] * fs, p[2] * fs)

    def _bucket_init(self, domain: str, prompt_tokens: int) -> _Models:
        ttft, tpot = self._bucket_coef(domain, prompt_tokens)
        v = self.prior.prior.prior_variance
        return _Models(BayesianRLS(ttft, v, self._forgetting),
                       BayesianRLS(tpot, v, self._forgetting))

    def predict(self, domain: str, prompt_tokens: int, queue: float, batch: float,
                depth: int, cached_tokens: float = 0.0) -> Prediction:
        """TTFT and TPOT; the prefill part of TTFT counts only the ``prompt_tokens`` not
        among the ``cached_tokens`` the worker is expected to find in its prefix cache."""
        return self.predict_at(self.coefficients(domain, prompt_tokens), queue, batch, depth,
                               prompt_tokens, cached_tokens)

    def coefficients(self, domain: str, prompt_tokens: int) -> tuple[Vec, Vec, int]:
        """(TTFT coefficients, TPOT coefficients, the bucket's samples) for a shape: what
        :meth:`predict_at` evaluates; valid until the next :meth:`observe`."""
        bucket = self._buckets.get((domain, prompt_band(prompt_tokens)))
        if bucket is None:
            # NOTE: no model is built for a bucket without samples (predict runs several
            # times per routing decision); its coefficients are derived on the fly.
            ct, cp = self._bucket_coef(domain, prompt_tokens)
            return ct, cp, 0
        return bucket.ttft.coef, bucket.tpot.coef, bucket.tpot.num_samples

    def predict_at(self, coef: tuple[Vec, Vec, int], queue: float, batch: float, depth: int,
                   prompt_tokens: int, cached_tokens: float = 0.0) -> Prediction:
        """:meth:`predict` from the shape's :meth:`coefficients` (a router prices one shape
        at several loads)."""
        # NOTE: the features and min / max written out as comparisons that pick the same
        # operand (tests/router/test_same_decisions.py): this runs 2-3 times a candidate
        ct, cp, n = coef
        cap = self._cap
        new_tokens = max(prompt_tokens - int(cached_tokens), 1) if cached_tokens > 0 \
            else prompt_tokens  # uncached()
        q = cap if cap < queue else queue
        b = cap if cap < batch else batch
        c0 = ct[0]
        prefill = ct[1] * (new_tokens / 1000.0)
        ttft = c0 + prefill + ct[2] * (q / 8.0)
        floor_ttft = 0.1 * c0 if c0 > 0 else 1e-4
        if floor_ttft > ttft:  # floors: a fit may extrapolate below zero far from its data
            ttft = floor_ttft
        if 1e-4 > ttft:
            ttft = 1e-4
        tpot = cp[0] + cp[1] * (b / 8.0) + cp[2] * (depth / 4.0)
        if 1e-5 > tpot:
            tpot = 1e-5
        if 0.0 > prefill:
            prefill = 0.0
        if self._all.ttft.num_samples == 0:
            c = self.calibration.factor(ttft_key(new_tokens))
            ttft, prefill = ttft * c, prefill * c
        if self._all.tpot.num_samples == 0:
            tpot *= self.calibration.factor(TPOT_KEY)
        return Prediction(ttft, tpot, n, prefill)

    def predict_candidate(self, domain: str, prompt_tokens: int, queue: float, batch: float,
                          depth: int, cached_tokens: float = 0.0
                          ) -> tuple[float, float, float, float, float, float]:
        """What a router's candidate needs of the profile, in one call: (TTFT, TPOT, prefill)
        of :meth:`predict` at ``queue`` and ``batch``; TTFT and TPOT at queue 0 and batch 1
        (the worker idle; the prefill is the same); and the TTFT with nothing cached (the
        loaded TTFT when ``cached_tokens`` is 0). The same operations as those calls of
        :meth:`predict`, so the same values bit for bit (tests/router/test_same_decisions.py)."""
        bucket = self._buckets.get((domain, prompt_band(prompt_tokens)))
        if bucket is None:  # coefficients()
            ct, cp = self._bucket_coef(domain, prompt_tokens)
        else:
            ct, cp = bucket.ttft._w, bucket.tpot._w
        cap = self._cap
        new_tokens = max(prompt_tokens - int(cached_tokens), 1) if cached_tokens > 0 \
            else prompt_tokens  # uncached()
        q = cap if cap < queue else queue
        b = cap if cap < batch else batch
        b1 = cap if cap < 1 else 1
        c0, c1, c2 = ct
        prefill = c1 * (new_tokens / 1000.0)
        head = c0 + prefill
        load = c2 * (q / 8.0)
        ttft = head + load
        idle_ttft = head + c2 * (0 / 8.0)
        floor_ttft = 0.1 * c0 if c0 > 0 else 1e-4
        if floor_ttft > ttft:
            ttft = floor_ttft
        if 1e-4 > ttft:
            ttft = 1e-4
        if floor_ttft > idle_ttft:
            idle_ttft = floor_ttft
        if 1e-4 > idle_ttft:
            idle_ttft = 1e-4
        full_ttft = ttft
        if cached_tokens > 0:  # predict() with nothing cached: the whole prompt to prefill
            full_ttft = c0 + c1 * (prompt_tokens / 1000.0) + load
            if floor_ttft > full_ttft:
                full_ttft = floor_ttft
            if 1e-4 > full_ttft:
                full_ttft = 1e-4
        p0, p1, p2 = cp
        spec = p2 * (depth / 4.0)
        tpot = p0 + p1 * (b / 8.0) + spec
        idle_tpot = p0 + p1 * (b1 / 8.0) + spec
        if 1e-5 > tpot:
            tpot = 1e-5
        if 1e-5 > idle_tpot:
            idle_tpot = 1e-5
        if 0.0 > prefill:
            prefill = 0.0
        if self._all.ttft.num_samples == 0:
            c = self.calibration.factor(ttft_key(new_tokens))
            ttft, idle_ttft, prefill = ttft * c, idle_ttft * c, prefill * c
            if cached_tokens > 0:
                full_ttft *= self.calibration.factor(ttft_key(prompt_tokens))
            else:
                full_ttft = ttft
        if self._all.tpot.num_samples == 0:
            c = self.calibration.factor(TPOT_KEY)
            tpot, idle_tpot = tpot * c, idle_tpot * c
        return ttft, tpot, prefill, idle_ttft, idle_tpot, full_ttft

    def observe(self, domain: str, prompt_tokens: int, queue: float, batch: float, depth: int,
                ttft_s: float | None, tpot_s: float | None, cached_tokens: float = 0.0
                ) -> None:
        """One finished request."""
        has_ttft = ttft_s is not None and ttft_s >= 0 and math.isfinite(ttft_s)
        has_tpot = tpot_s is not None and tpot_s > 0 and math.isfinite(tpot_s)
        if has_tpot and self._all.tpot.num_samples == 0:
            # NOTE: the worker's first TPOT sample starts its fit from the calibrated prior.
            # TTFT is calibrated per prompt band, so no one factor fits its worker-level
            # model: that one starts from the raw prior and learns.
            self._all.tpot.rescale(self.calibration.factor(TPOT_KEY))
        key = (domain, prompt_band(prompt_tokens))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._bucket_init(domain, prompt_tokens)
        cap = self._cap
        new_tokens = uncached(prompt_tokens, cached_tokens)
        xt = ttft_features(new_tokens, min(queue, cap))
        xp = tpot_features(min(batch, cap), depth)
        prior = self.prior
        f = prior.factor(domain, prompt_tokens)
        if has_ttft:
            assert ttft_s is not None
            bucket.ttft.update(xt, ttft_s)
            self._all.ttft.update(xt, ttft_s / f)
            # LatencyPrior.ttft_s(domain, new_tokens, min(queue, cap)), on its features xt
            c = prior.ttft_coef()
            self.calibration.observe(ttft_key(new_tokens), ttft_s,
                                     (c[0] + c[1] * xt[1] + c[2] * xt[2])
                                     * prior.factor(domain, new_tokens))
        if has_tpot:
            assert tpot_s is not None
            bucket.tpot.update(xp, tpot_s)
            self._all.tpot.update(xp, tpot_s / (f * self._spec_ratio(domain)))
            # LatencyPrior.tpot_s(domain, prompt_tokens, batch, depth), on its features xp
            # (the prior's capacity is the profile's)
            c = prior.tpot_coef(domain)
            self.calibration.observe(TPOT_KEY, tpot_s,
                                     (c[0] + c[1] * xp[1] + c[2] * xp[2]) * f)

    def tpot_per_seq_s(self) -> float:
        """What one more sequence in the batch adds to every running request's TPOT,
        seconds: the worker-level fit's batch slope (calibrated prior before samples)."""
        slope = max(self._all.tpot.coef[1], 0.0) / 8.0
        if self._all.tpot.num_samples == 0:
            slope *= self.calibration.factor(TPOT_KEY)
        return slope

    def num_samples(self, domain: str, prompt_tokens: int) -> int:
        bucket = self._buckets.get((domain, prompt_band(prompt_tokens)))
        return bucket.tpot.num_samples if bucket else 0

    def snapshot(self) -> dict[str, object]:
        return {"num_samples": self._all.tpot.num_samples,
                "calibration": self.calibration.snapshot(),
                "buckets": {f"{d}/{b}": m.tpot.num_samples for (d, b), m in self._buckets.items()},
                "bucket_tpot_coef": {f"{d}/{b}": [round(v, 6) for v in m.tpot.coef]
                                     for (d, b), m in self._buckets.items()},
                "ttft_coef": [round(v, 5) for v in self._all.ttft.coef],
                "tpot_coef": [round(v, 6) for v in self._all.tpot.coef]}
