"""Fitting a load-adaptive speculative-depth schedule for a vLLM worker.

vLLM picks one speculative depth k per engine step for the whole batch. Since
vLLM 0.32 the speculative config takes a batch-size schedule,
``num_speculative_tokens_per_batch_size: [[start, end, k], ...]`` (inclusive
ranges, the first starting at 1, non-overlapping; k >= 0 and capped by
``num_speculative_tokens``; see ``vllm/config/speculative.py`` and
``vllm/v1/spec_decode/dynamic/utils.py``). The scheduler looks k up by the
number of requests in the step.

The fit, for every batch size b in 1..max_num_seqs::

    k*(b) = argmax_k  sum_d w_d(b) * E(a_d, k) / t(b, k)      (tokens per second per sequence)

where ``w_d(b)`` is the share of output tokens of domain d among requests that
ran at load b (from traces: concurrency on the worker at each arrival),
``a_d`` the per-token acceptance of domain d (measured: the proxy's scraped
``vllm:spec_decode_*`` deltas, or the traces' counts), ``E(a, k) =
(1 - a^(k+1)) / (1 - a)`` the tokens one step emits and ``t(b, k)`` the step
time (:class:`specdec.step_model.StepTimeModel`, a prior refined by the traces).
k is 0 unless it beats plain decoding by ``min_gain``. Runs of equal k become
the ranges vLLM takes::

    >>> model = StepTimeModel.from_coefficients((0.010, 0.001, 0.0005, 0.0))
    >>> s = fit_schedule([], acceptance={"chat": 0.7}, step_time=model,
    ...                  config=ScheduleConfig(max_num_seqs=64, max_depth=4))
    >>> s.ranges
    ((1, 3, 4), (4, 8, 3), (9, 42, 2), (43, 64, 1))
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyinfer.config import CompiledConfig
from specdec.errors import ProposerConfigError
from specdec.policy import PolicyConfig, expected_tokens_per_step, solve_acceptance
from specdec.step_model import StepTimeModel

TraceRecord = Mapping[str, Any]  # one trace record (DESIGN.md schema)
Range = tuple[int, int, int]  # (first batch size, last batch size, k), inclusive


@dataclass(frozen=True)
class ScheduleConfig:
    max_num_seqs: int = 256  # the worker's batch cap: the schedule covers 1..max_num_seqs
    max_depth: int = 5  # never speculate deeper
    min_gain: float = 1.03  # speculate only if the goodput beats k=0 by this factor
    prior_acceptance: float = 0.5  # for a domain with no measurement
    # load levels whose domain mix is estimated separately (upper bounds of batch buckets)
    load_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    min_bucket_requests: int = 20  # fewer requests than this: the bucket uses the overall mix

    def __post_init__(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs", ">= 1"),
            (1 <= self.max_depth <= 16, "max_depth", "1..16"),
            (self.min_gain >= 1.0, "min_gain", ">= 1"),
            (0.0 <= self.prior_acceptance < 1.0, "prior_acceptance", "in [0, 1)"),
            (len(self.load_buckets) > 0 and list(self.load_buckets) == sorted(
                set(self.load_buckets)) and self.load_buckets[0] >= 1, "load_buckets",
             "strictly increasing positive integers"),
            (self.min_bucket_requests >= 1, "min_bucket_requests", ">= 1"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ProposerConfigError(
                    f"schedule.{name}: expected {expected}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SpeculativeSchedule:
    """k per batch size, as data and as vLLM's ranges."""

    per_batch_k: tuple[int, ...]  # [max_num_seqs]: k for batch size b at index b - 1
    gain: tuple[float, ...]  # [max_num_seqs]: predicted goodput at k*(b) over k = 0
    acceptance: Mapping[str, float]  # per-token acceptance used, per domain

    @property
    def ranges(self) -> tuple[Range, ...]:
        """Runs of equal k: vLLM's ``num_speculative_tokens_per_batch_size``."""
        out: list[Range] = []
        for b, k in enumerate(self.per_batch_k, start=1):
            if out and out[-1][2] == k:
                out[-1] = (out[-1][0], b, k)
            else:
                out.append((b, b, k))
        return tuple(out)

    @property
    def max_k(self) -> int:
        return max(self.per_batch_k, default=0)

    def k_for(self, batch_size: int) -> int:
        """k at ``batch_size`` (past the cap, the last range's k, as vLLM carries it forward)."""
        return self.per_batch_k[min(max(batch_size, 1), len(self.per_batch_k)) - 1]

    def speculative_config(self, base: Mapping[str, Any]) -> dict[str, Any] | None:
        """``base`` (method, prompt_lookup_*, model, ...) with this schedule; None = don't speculate.

        ``num_speculative_tokens`` becomes the schedule's largest k (vLLM caps every
        range by it and sizes its buffers from it).
        """
        if self.max_k == 0:
            return None
        return {**base, "num_speculative_tokens": self.max_k,
                "num_speculative_tokens_per_batch_size": [list(r) for r in self.ranges]}

    def speculative_config_json(self, base: Mapping[str, Any]) -> str:
        """The same as JSON text for ``VllmConfig.speculative_config`` ("" = no speculation)."""
        spec = self.speculative_config(base)
        return json.dumps(spec, separators=(",", ":")) if spec is not None else ""


def with_schedule(config: CompiledConfig, schedule: SpeculativeSchedule) -> CompiledConfig:
    """``config`` with ``schedule`` in its vLLM speculative config (method and options kept).

    The result is what a blue-green replacement (:mod:`proxy.bluegreen`) starts;
    an all-zero schedule drops speculation altogether.
    """
    base = {k: v for k, v in (config.vllm.speculative or {}).items()
            if k not in ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")}
    if schedule.max_k > 0 and not ("method" in base or "model" in base):
        raise ProposerConfigError("with_schedule: the config's vllm.speculative_config names no "
                                  "'method' or 'model' to schedule")
    vllm = dataclasses.replace(config.vllm,
                               speculative_config=schedule.speculative_config_json(base))
    return dataclasses.replace(config, vllm=vllm)


def fit_schedule(traces: Iterable[TraceRecord], *, acceptance: Mapping[str, float] | None = None,
                 step_time: StepTimeModel | None = None, config: ScheduleConfig | None = None,
                 worker: str | None = None, worker_depth: int | None = None
                 ) -> SpeculativeSchedule:
    """Fit k per batch size from traces and measured acceptance (see the module docstring).

    ``traces``: trace records (``worker`` filters them to one worker's). ``acceptance``:
    measured per-token acceptance per domain; it wins over what the traces' counts say.
    ``step_time``: a step-time model (default: the depth policy's prior), refined in a
    copy by the traces' decode times; ``worker_depth`` is the k those traces ran with
    when their records carry none (vLLM workers: the worker's num_speculative_tokens).
    """
    cfg = config or ScheduleConfig()
    records = [r for r in traces if _usable(r) and (worker is None or r.get("worker") == worker)]
    loads = concurrency_at_arrival(records)
    accept = {**acceptance_from_traces(records, worker_depth), **(acceptance or {})}
    model = fit_step_time(records, loads, step_time, worker_depth)
    mixes = domain_mix_by_load(records, loads, cfg)
    per_k: list[int] = []
    gains: list[float] = []
    for b in range(1, cfg.max_num_seqs + 1):
        k, gain = best_depth(mixes[_bucket(b, cfg)], accept, b, model, cfg)
        per_k.append(k)
        gains.append(gain)
    return SpeculativeSchedule(tuple(per_k), tuple(gains), dict(accept))


def best_depth(mix: Mapping[str, float], acceptance: Mapping[str, float], batch: int,
               step_time: StepTimeModel, config: ScheduleConfig) -> tuple[int, float]:
    """(k, goodput gain over k=0) maximising the mix's expected tokens per second at ``batch``."""
    if not mix:  # no traces: the measured domains, equally weighted
        mix = {d: 1.0 / len(acceptance) for d in acceptance} if acceptance else {"": 1.0}
    base = 1.0 / step_time.predict(batch, 0)
    best_k, best = 0, base
    for k in range(1, config.max_depth + 1):
        tokens = sum(w * expected_tokens_per_step(
            acceptance.get(d, config.prior_acceptance), k) for d, w in mix.items())
        goodput = tokens / step_time.predict(batch, k)
        if goodput > best and goodput >= base * config.min_gain:
            best_k, best = k, goodput
    return best_k, best / base


def concurrency_at_arrival(records: Sequence[TraceRecord]) -> list[int]:
    """For each record, requests in flight on its worker when it arrived, counting itself."""
    loads = [1] * len(records)
    by_worker: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_worker[str(r.get("worker") or "")].append(i)
    for idx in by_worker.values():
        start = np.array([float(records[i]["ts"]) for i in idx])  # [n] seconds
        end = start + np.array([float(records[i]["e2e_s"]) for i in idx])  # [n]
        ends = np.sort(end)
        starts = np.sort(start)
        # started at or before me, minus finished at or before my arrival
        num_started = np.searchsorted(starts, start, side="right")
        num_ended = np.searchsorted(ends, start, side="right")
        for j, i in enumerate(idx):
            loads[i] = max(1, int(num_started[j] - num_ended[j]))
    return loads


def acceptance_from_counts(num_draft: float, num_accepted: float, depth: int) -> float:
    """Per-token acceptance a from draft/accepted counts of steps that proposed ``depth`` tokens.

    With k tokens proposed per step, a step accepts ``sum_{i<=k} a^i`` on average,
    so ``a`` solves that for the observed ``accepted / (draft / k)``.
    """
    if num_draft <= 0 or depth <= 0:
        raise ProposerConfigError(f"acceptance_from_counts: expected draft > 0 and depth > 0, "
                                  f"got draft={num_draft}, depth={depth}")
    steps = num_draft / depth
    return solve_acceptance(min(max(num_accepted, 0.0), num_draft) / steps, depth)


def acceptance_from_traces(records: Iterable[TraceRecord],
                           worker_depth: int | None = None) -> dict[str, float]:
    """Per-domain acceptance from the records' ``spec_draft_tokens``/``spec_accepted_tokens``."""
    counts: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        draft = r.get("spec_draft_tokens") or 0
        depth = r.get("spec_depth") or worker_depth or 0
        if draft > 0 and depth > 0:
            pair = counts[(str(r.get("domain") or ""), int(depth))]
            pair[0] += draft
            pair[1] += r.get("spec_accepted_tokens") or 0
    per_domain: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (domain, depth), (draft, accepted) in counts.items():
        a = acceptance_from_counts(draft, accepted, depth)
        per_domain[domain][0] += a * draft  # draft-weighted over the depths seen
        per_domain[domain][1] += draft
    return {d: s / n for d, (s, n) in per_domain.items() if n > 0}


def fit_step_time(records: Sequence[TraceRecord], loads: Sequence[int],
                  prior: StepTimeModel | None = None,
                  worker_depth: int | None = None) -> StepTimeModel:
    """A copy of ``prior`` refined with each record's mean decode-step time at its load.

    A request that emitted n tokens after its first, with m drafts accepted, ran
    ``n - m`` decode steps in ``e2e_s - ttft_s`` seconds.
    """
    if prior is None:
        c = PolicyConfig()
        prior = StepTimeModel.from_prior(c.step_prior_s, c.step_prior_weight)
    model = StepTimeModel(prior.prior_xtx.copy(), prior.prior_xty.copy(), prior.decay,
                          prior.xtx.copy(), prior.xty.copy(), prior.num_samples)
    for r, load in zip(records, loads, strict=True):
        ttft, tokens = r.get("ttft_s"), r.get("completion_tokens") or 0
        if ttft is None or tokens < 2:
            continue
        steps = tokens - 1 - (r.get("spec_accepted_tokens") or 0)
        depth = r.get("spec_depth")
        depth = (worker_depth or 0) if depth is None else depth
        if steps > 0:
            model.observe(load, int(depth), (float(r["e2e_s"]) - float(ttft)) / steps)
    return model


def domain_mix_by_load(records: Sequence[TraceRecord], loads: Sequence[int],
                       config: ScheduleConfig) -> dict[int, dict[str, float]]:
    """Output-token share per domain, per load bucket (the overall mix where data is thin)."""
    tokens: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    num_requests: dict[int, int] = defaultdict(int)
    overall: dict[str, float] = defaultdict(float)
    for r, load in zip(records, loads, strict=True):
        bucket = _bucket(load, config)
        n = float(r.get("completion_tokens") or r.get("max_tokens") or 1)
        domain = str(r.get("domain") or "")
        tokens[bucket][domain] += n
        num_requests[bucket] += 1
        overall[domain] += n
    mixes = {}
    for bucket in config.load_buckets:
        src = tokens[bucket] if num_requests[bucket] >= config.min_bucket_requests else overall
        total = sum(src.values())
        mixes[bucket] = {d: v / total for d, v in src.items()} if total > 0 else {}
    return mixes


def _bucket(load: int, config: ScheduleConfig) -> int:
    for upper in config.load_buckets:
        if load <= upper:
            return upper
    return config.load_buckets[-1]


def _usable(r: TraceRecord) -> bool:
    ts, e2e = r.get("ts"), r.get("e2e_s")
    return (r.get("status", "ok") == "ok" and isinstance(ts, (int, float))
            and isinstance(e2e, (int, float)) and math.isfinite(e2e) and e2e >= 0)
