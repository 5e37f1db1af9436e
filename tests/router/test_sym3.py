"""router.sym3 and the plain-float RLS update against the numpy formulas they replace."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.profiles import OUTLIER_FACTOR, BayesianRLS
from router.sym3 import clip_eigenvalues, eigvals, eigvec


def _numpy_clip(a: np.ndarray, cap: float) -> np.ndarray:
    eig, vec = np.linalg.eigh(0.5 * (a + a.T))
    return (vec * np.clip(eig, 0.0, cap)) @ vec.T


def _random_psd(rng: random.Random, scale: float) -> np.ndarray:
    m = np.array([[rng.gauss(0, 1) for _ in range(3)] for _ in range(3)])
    q, _ = np.linalg.qr(m)
    eig = [scale * rng.choice((rng.random(), rng.uniform(0.9, 1.1), 1e-9 * rng.random()))
           for _ in range(3)]
    return (q * eig) @ q.T


def test_eigvals_of_a_diagonal_and_a_known_matrix() -> None:
    assert eigvals(((2.0, 0.0, 0.0), (0.0, 5.0, 0.0), (0.0, 0.0, 1.0))) == (5.0, 2.0, 1.0)
    # [[2, 1, 0], [1, 2, 0], [0, 0, 4]]: 4, 3, 1
    hi, mid, lo = eigvals(((2.0, 1.0, 0.0), (1.0, 2.0, 0.0), (0.0, 0.0, 4.0)))
    assert (hi, mid, lo) == pytest.approx((4.0, 3.0, 1.0), abs=1e-12)
    v = eigvec(((2.0, 1.0, 0.0), (1.0, 2.0, 0.0), (0.0, 0.0, 4.0)), 3.0)
    assert v is not None and abs(v[0]) == pytest.approx(2 ** -0.5) and v[0] == pytest.approx(v[1])


def test_clip_within_bounds_returns_the_matrix_itself() -> None:
    a = ((0.5, 0.1, 0.0), (0.1, 0.5, 0.0), (0.0, 0.0, 0.5))
    assert clip_eigenvalues(a, 1.0) is a


def test_clip_matches_eigh_on_random_matrices() -> None:
    rng = random.Random(7)
    num_closed = 0
    for _ in range(3000):
        cap = rng.choice((1.0, 0.3, 5.0))
        a = _random_psd(rng, cap * rng.uniform(0.5, 2.5))
        got = clip_eigenvalues(tuple(map(tuple, a.tolist())), cap)  # type: ignore[arg-type]
        if got is None:
            continue
        num_closed += 1
        want = _numpy_clip(a, cap)
        assert np.allclose(np.array(got), want, rtol=0, atol=1e-12 * max(cap, np.abs(a).max()))
    assert num_closed > 2500  # the closed form is the common path, not the fallback


def test_clip_declines_a_negative_eigenvalue() -> None:
    assert clip_eigenvalues(((1.0, 0.0, 0.0), (0.0, -1e-3, 0.0), (0.0, 0.0, 0.5)), 1.0) is None


class _NumpyRLS:
    """The update as it was first written, in numpy, for comparison."""

    def __init__(self, prior: tuple[float, float, float], v: float, lam: float) -> None:
        self.scale = max(abs(prior[0]), 1e-6)
        self.theta = np.asarray(prior, dtype=np.float64) / self.scale
        self.p, self.lam, self.cap = np.eye(3) * v, lam, v

    def update(self, x: tuple[float, float, float], y: float) -> None:
        xv = np.asarray(x)
        px = self.p @ xv
        gain = px / (self.lam + xv @ px)
        pred = float(xv @ self.theta)
        target = y / self.scale
        if pred > 0:
            target = min(max(target, pred / OUTLIER_FACTOR), pred * OUTLIER_FACTOR)
        self.theta = self.theta + gain * (target - pred)
        self.p = _numpy_clip((self.p - np.outer(gain, px)) / self.lam, self.cap)


@pytest.mark.parametrize("seed", range(6))
def test_rls_update_matches_the_numpy_formula(seed: int) -> None:
    rng = random.Random(seed)
    prior = (rng.uniform(0.001, 0.05), rng.uniform(0.0, 0.02), rng.uniform(-0.01, 0.01))
    v, lam = rng.choice((1.0, 0.25, 4.0)), rng.choice((0.98, 0.9, 1.0))
    new, old = BayesianRLS(prior, v, lam), _NumpyRLS(prior, v, lam)
    for i in range(400):
        # mostly one feature unexcited (the depth on a non-speculating worker), as served
        x = (1.0, rng.uniform(0, 4), 0.0 if i % 5 else rng.uniform(0, 2))
        y = abs(prior[0] + 0.003 * x[1] + rng.gauss(0, 0.004)) * rng.choice((1, 1, 1, 6))
        new.update(x, y)
        old.update(x, y)
        assert np.allclose(new.theta, old.theta, rtol=1e-9, atol=1e-12), i
        assert np.allclose(new.p, old.p, rtol=1e-9, atol=1e-12 * v), i
        probe = (1.0, rng.uniform(0, 4), rng.uniform(0, 2))
        assert new.predict(probe) == pytest.approx(float(np.dot(probe, old.theta * old.scale)),
                                                   rel=1e-9, abs=1e-15)
