"""The cost model: roofline from measured hardware constants + regressions on measurements.

Three layers, each learned from something measured on this machine:

1. ``HardwareConstants.measure()``: memory bandwidth (a large array copy) and
   matmul FLOP/s (a square float32 matmul), seconds.
2. ``ForwardTimeModel.fit()``: times forward passes of a layer stack of the
   model's shape (the real matmuls + activation, synthetic weights) at several
   token counts and fits ``step_s = c0 + c1 * roofline_s(tokens)``; ``c0`` is
   the per-step overhead the roofline cannot see.
3. ``CostModel.calibrate()``: once candidates are measured, a ridge regression
   of ``log(measured / predicted)`` on the encoded config corrects what the
   analytic throughput model gets wrong (scheduler effects, compile, ...).

``predict(config, profile)`` -> output tokens/s for a closed-loop replay of
the profile's traffic at a given concurrency. The pruner uses it to skip
candidates predicted to be clearly worse than the incumbent.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optimizer.profile import TrafficProfile
from optimizer.space import ModelShape, SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)

# NOTE: priors for the acceptance rate per proposed token when the traces have
# none for a domain: prompt lookup hits on code and extraction, little elsewhere.
NGRAM_ACCEPT_PRIOR = {"code": 0.45, "extraction": 0.4, "rag": 0.3, "summarization": 0.25}
NGRAM_ACCEPT_DEFAULT = 0.1
DRAFT_ACCEPT_DEFAULT = 0.5


@dataclass(frozen=True)
class HardwareConstants:
    mem_bandwidth_bps: float  # bytes / second, streaming copy
    matmul_flops: float  # float32 FLOP / second

    @classmethod
    def measure(cls, size_mb: int = 64, matmul_n: int = 512, repeats: int = 3) -> HardwareConstants:
        src = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
        dst = np.empty_like(src)
        copy_s = _best_of(lambda: np.copyto(dst, src), repeats)
        import torch

        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        mm_s = _best_of(lambda: torch.mm(a, b), repeats + 2)
        return cls(mem_bandwidth_bps=2 * src.nbytes / copy_s, matmul_flops=2 * matmul_n ** 3 / mm_s)


def _best_of(fn: object, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def roofline_s(shape: ModelShape, hw: HardwareConstants, num_tokens: int,
               num_layers: int | None = None, bytes_per_param: int = 4) -> float:
    """Lower bound on one forward pass over ``num_tokens`` tokens: weights once, 2 FLOP/param."""
    params = shape.num_params(num_layers)
    return max(params * bytes_per_param / hw.mem_bandwidth_bps,
               2.0 * params * num_tokens / hw.matmul_flops)


@dataclass(frozen=True)
class ForwardTimeModel:
    """step_s(tokens) = overhead_s + scale * roofline_s(tokens), fitted on timed passes.

    NOTE: a prior for configs never run, from a synthetic layer stack timed here; not
    :class:`specdec.step_model.StepTimeModel`, which a worker's own decode steps fit online.
    """

    shape: ModelShape
    hw: HardwareConstants
    overhead_s: float  # per step, seconds (per layer-stack of full depth)
    scale: float  # measured / roofline slope
    samples: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) that were timed

    def step_s(self, num_tokens: int, num_layers: int | None = None) -> float:
        layers = self.shape.num_layers if num_layers is None else num_layers
        frac = layers / self.shape.num_layers
        return self.overhead_s * frac + self.scale * roofline_s(self.shape, self.hw, num_tokens,
                                                                layers)

    @classmethod
    def fit(cls, shape: ModelShape, hw: HardwareConstants,
            token_counts: Sequence[int] = (1, 4, 16, 64, 256), repeats: int = 3
            ) -> ForwardTimeModel:
        samples = tuple((n, _time_layer_stack(shape, n, repeats)) for n in token_counts)
        x = np.array([roofline_s(shape, hw, n) for n, _ in samples])
        y = np.array([s for _, s in samples])
        design = np.stack([np.ones_like(x), x], axis=1)
        (c0, c1), *_ = np.linalg.lstsq(design, y, rcond=None)
        return cls(shape, hw, overhead_s=max(0.0, float(c0)), scale=max(0.1, float(c1)),
                   samples=samples)


def _time_layer_stack(shape: ModelShape, num_tokens: int, repeats: int) -> float:
    """Best-of wall time of one forward over all layers (matmuls, SiLU MLP, LM head)."""
    import torch

    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    g = torch.Generator().manual_seed(0)
    w_qkv = torch.randn(h, q + 2 * kv, generator=g) * 0.02
    w_o = torch.randn(q, h, generator=g) * 0.02
    w_up = torch.randn(h, 2 * i, generator=g) * 0.02
    w_down = torch.randn(i, h, generator=g) * 0.02
    w_head = torch.randn(h, shape.vocab_size, generator=g) * 0.02
    x0 = torch.randn(num_tokens, h, generator=g)  # (T, h)

    def forward() -> None:
        with torch.inference_mode():
            x = x0
            for _ in range(shape.num_layers):
                x = x + (x @ w_qkv)[:, :q] @ w_o
                gate, up = (x @ w_up).chunk(2, dim=-1)  # (T, i) each
                x = x + (torch.nn.functional.silu(gate) * up) @ w_down
            _ = x[-1:] @ w_head

    # NOTE: timed on the threads an engine uses by default (num_threads 0: half the cores);
    # all of them would also thrash on a box whose other cores are busy (9 s against 1 s
    # for this fit on a loaded 2-core box)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        forward()
        return _best_of(forward, repeats)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Workload:
    """The replay the objective is measured on, as the cost model sees it."""

    concurrency: int  # closed-loop clients
    profile: TrafficProfile
    max_prompt_tokens: int = 256
    max_output_tokens: int = 48

    def mean_prompt(self) -> float:
        return max(1.0, min(self.profile.prompt_tokens.mean, self.max_prompt_tokens))

    def mean_output(self) -> float:
        return max(1.0, min(self.profile.output_tokens.mean, self.max_output_tokens))

    def acceptance(self, method: str) -> float:
        """Traffic-weighted per-token acceptance rate for a speculation method."""
        if method == "none" or not self.profile.domain_mix:
            return 0.0
        total = 0.0
        for domain, share in self.profile.domain_mix.items():
            measured = self.profile.acceptance_by_domain.get(domain)
            prior = (NGRAM_ACCEPT_PRIOR.get(domain, NGRAM_ACCEPT_DEFAULT) if method == "ngram"
                     else DRAFT_ACCEPT_DEFAULT)
            total += share * (measured if measured is not None else prior)
        return min(0.95, total)


def expected_tokens_per_step(alpha: float, depth: int) -> float:
    """Tokens emitted per verify step with k proposals accepted i.i.d. at rate alpha."""
    if depth <= 0 or alpha <= 0:
        return 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


class CostModel:
    """Predicts output tokens/s of a config on a workload; calibrated on measured results."""

    def __init__(self, space: SearchSpace, steps: ForwardTimeModel,
                 draft_shape: ModelShape | None = None) -> None:
        self.space = space
        self.steps = steps
        self.draft_shape = draft_shape
        self._coef: np.ndarray | None = None  # ridge weights on [1, encode(cfg)]
        self.num_calibration_points = 0

    def analytic(self, cfg: CompiledConfig, work: Workload, num_layers: int | None = None) -> float:
        e = cfg.engine
        seq_tokens = work.mean_prompt() + work.mean_output()
        fit_kv = max(1, int(e.kv_cache_tokens // seq_tokens))
        batch = max(1, min(e.max_num_seqs, work.concurrency, fit_kv))
        depth = e.spec_default_depth if e.spec_method != "none" else 0
        per_step = expected_tokens_per_step(work.acceptance(e.spec_method), depth)
        decode_tokens = batch * (1 + depth)
        decode_s = self.steps.step_s(decode_tokens, num_layers) + self._draft_s(e.spec_method,
                                                                                 batch, depth)
        chunk = max(1, min(e.max_num_batched_tokens, int(batch * work.mean_prompt())))
        prefill_s_per_token = self.steps.step_s(chunk, num_layers) / chunk
        # NOTE: per request: its prompt's share of prefill steps, then its decode steps
        # shared with `batch` others; a queue forms when concurrency > batch.
        per_request_s = (work.mean_prompt() * prefill_s_per_token
                         + work.mean_output() / per_step * decode_s / batch)
        return work.mean_output() / per_request_s

    def _draft_s(self, method: str, batch: int, depth: int) -> float:
        if method == "draft" and self.draft_shape is not None:
            params = self.draft_shape.num_params()
            one = max(params * 4 / self.steps.hw.mem_bandwidth_bps,
                      2.0 * params * batch / self.steps.hw.matmul_flops)
            return depth * (one + self.steps.overhead_s * self.draft_shape.num_layers
                            / self.steps.shape.num_layers)
        if method == "ngram":
            return 2e-5 * batch * depth  # prompt lookup on the CPU: tiny, but not free
        return 0.0

    def predict(self, cfg: CompiledConfig, work: Workload, num_layers: int | None = None) -> float:
        base = self.analytic(cfg, work, num_layers)
        if self._coef is None:
            return base
        x = np.concatenate([[1.0], self.space.encode(cfg)])
        return base * float(np.exp(np.clip(x @ self._coef, -3.0, 3.0)))

    def calibrate(self, measured: Sequence[tuple[CompiledConfig, float]], work: Workload,
                  num_layers: int | None = None, ridge: float = 1.0) -> None:
        """Fit the log-ratio correction on (config, measured tokens/s) pairs."""
        pairs = [(c, v) for c, v in measured if v > 0]
        self.num_calibration_points = len(pairs)
        if len(pairs) < 2:
            self._coef = None
            return
        x = np.stack([np.concatenate([[1.0], self.space.encode(c)]) for c, _ in pairs])
        y = np.array([math.log(v / self.analytic(c, work, num_layers)) for c, v in pairs])
        penalty = ridge * np.eye(x.shape[1])
        penalty[0, 0] = 1e-6  # NOTE: the intercept (overall scale) is not shrunk
        self._coef = np.linalg.solve(x.T @ x + penalty, x.T @ y)
