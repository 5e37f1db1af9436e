"""Cost-model pruning with an audit: skip clearly-worse candidates, check a sample of the skips.

A candidate is pruned when the calibrated cost model predicts it below
``(1 - margin)`` of the best value measured so far in the screening tier.
Every ``audit_every``-th prune is measured anyway; the prune was *wrong* when
the measured value was not clearly worse after all (>= the same threshold).
Until the model has ``min_calibration`` measured points it prunes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from polyinfer.config import CompiledConfig


@dataclass(frozen=True)
class PruneConfig:
    margin: float = 0.25  # prune below (1 - margin) x best measured
    audit_every: int = 3  # measure every n-th pruned candidate anyway (0 = never)
    min_calibration: int = 3  # measured points needed before pruning at all

    def __post_init__(self) -> None:
        if not 0.0 < self.margin < 1.0 or self.audit_every < 0 or self.min_calibration < 0:
            raise ValueError("prune: margin in (0, 1), audit_every >= 0, min_calibration >= 0")


@dataclass(frozen=True)
class PruneDecision:
    prune: bool
    audit: bool  # pruned, but measure it anyway to check the model
    predicted: float
    threshold: float


class Pruner:
    def __init__(self, config: PruneConfig, predict: Callable[[CompiledConfig], float]) -> None:
        self.config = config
        self.predict = predict
        self.num_considered = 0
        self.num_pruned = 0
        self.num_audited = 0
        self.num_wrong = 0  # audited prunes that measured not clearly worse

    def decide(self, cfg: CompiledConfig, best_measured: float | None,
               num_calibration: int) -> PruneDecision:
        self.num_considered += 1
        predicted = self.predict(cfg)
        if best_measured is None or num_calibration < self.config.min_calibration:
            return PruneDecision(False, False, predicted, 0.0)
        threshold = (1.0 - self.config.margin) * best_measured
        if predicted >= threshold:
            return PruneDecision(False, False, predicted, threshold)
        self.num_pruned += 1
        audit = self.config.audit_every > 0 and self.num_pruned % self.config.audit_every == 0
        return PruneDecision(True, audit, predicted, threshold)

    def record_audit(self, decision: PruneDecision, measured: float) -> bool:
        """Returns whether the prune was wrong."""
        self.num_audited += 1
        wrong = measured >= decision.threshold
        self.num_wrong += wrong
        return wrong

    def snapshot(self) -> dict[str, float | int | None]:
        return {"considered": self.num_considered, "pruned": self.num_pruned,
                "audited": self.num_audited, "wrong": self.num_wrong,
                "wrong_rate": self.num_wrong / self.num_audited if self.num_audited else None}
