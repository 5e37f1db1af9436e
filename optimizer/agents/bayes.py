"""Bayesian optimisation: a Gaussian process on measured configs + expected improvement.

The GP (Matern 5/2 + white noise, normalised targets) models log tokens/s on
the unit-cube encoding of the space. Until ``num_init`` points are measured
it proposes random valid configs (space filling); then it scores a pool of
random configs plus neighbours of the best few by EI and proposes the top.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from typing import Any

import numpy as np
from scipy.optimize import minimize
from scipy.stats import norm
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, Kernel, Matern, WhiteKernel

from optimizer.agents.base import BoardView, Candidate, fresh
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float,
                         xi: float = 0.01) -> np.ndarray:
    """EI for maximisation; ``sigma`` 0 gives 0."""
    sigma = np.maximum(sigma, 1e-12)
    z = (mu - best - xi) / sigma
    return (mu - best - xi) * norm.cdf(z) + sigma * norm.pdf(z)


class BayesAgent:
    name = "bayes"

    def __init__(self, space: SearchSpace, seed: int = 0, num_init: int = 3,
                 pool_size: int = 300, max_iter: int = 60) -> None:
        self.space = space
        self.rng = random.Random(seed)
        self.num_init = num_init
        self.pool_size = pool_size
        self.max_iter = max_iter
        self._kernel: Kernel | None = None
        self._dim = 0

    def propose(self, view: BoardView, num: int) -> list[Candidate]:
        measured = {k: v for k, v in view.measured.items() if v > 0}
        if len(measured) < self.num_init:
            return self._random(view, num)
        keys = list(measured)
        x = np.stack([self.space.encode(self.space.from_key(k)) for k in keys])
        y = np.log(np.array([measured[k] for k in keys]))
        gp = self._fit(x, y)
        pool = self._pool(view, keys)
        if not pool:
            return []
        px = np.stack([self.space.encode(c) for c in pool])
        mu, sigma = gp.predict(px, return_std=True)
        ei = expected_improvement(mu, sigma, float(y.max()))
        order = np.argsort(-ei)[:num]
        return [Candidate(pool[i], predicted=float(math.exp(mu[i])),
                          reason=f"EI {ei[i]:.4f} mu {math.exp(mu[i]):.1f} sd {sigma[i]:.3f}")
                for i in order]

    def _fit(self, x: np.ndarray, y: np.ndarray) -> GaussianProcessRegressor:
        kernel = self._kernel if self._kernel is not None and self._dim == x.shape[1] else (
            ConstantKernel(1.0, (1e-3, 1e3))
            * Matern(length_scale=np.full(x.shape[1], 0.5), length_scale_bounds=(0.05, 20.0),
                     nu=2.5)
            + WhiteKernel(1e-3, (1e-6, 1e-1)))
        gp = GaussianProcessRegressor(kernel, normalize_y=True, optimizer=_lbfgs(self.max_iter),
                                      n_restarts_optimizer=0)
        with warnings.catch_warnings():
            # NOTE: length scales at their bounds are expected with a handful of points.
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x, y)
        # NOTE: warm start: the next fit (one more point) starts from these hyperparameters.
        self._kernel, self._dim = gp.kernel_, x.shape[1]
        return gp

    def _pool(self, view: BoardView, keys: list[str]) -> list[CompiledConfig]:
        configs = [self.space.sample(self.rng) for _ in range(self.pool_size)]
        for key, _ in view.top(3):
            configs.extend(self.space.neighbors(self.space.from_key(key)))
        return fresh(self.space, view, configs)

    def _random(self, view: BoardView, num: int) -> list[Candidate]:
        configs = fresh(self.space, view, [self.space.sample(self.rng) for _ in range(20 * num)])
        return [Candidate(c, reason="initial design (random)") for c in configs[:num]]


def _lbfgs(max_iter: int) -> Any:
    """sklearn's default optimiser with a cap on iterations (fits run once per proposal)."""

    def optimize(obj_func: Any, initial_theta: np.ndarray, bounds: np.ndarray) -> tuple[Any, Any]:
        res = minimize(obj_func, initial_theta, method="L-BFGS-B", jac=True, bounds=bounds,
                       options={"maxiter": max_iter})
        return res.x, res.fun

    return optimize
