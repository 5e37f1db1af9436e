"""Errors raised by the optimizer, one tree.

    OptimizerError                  base of everything below
    ├── TraceError                  a trace file cannot be opened at all
    ├── SpaceError                  a point is outside the search space or violates a constraint
    ├── BoardError                  the message board file cannot be used
    ├── MeasurementError            a candidate could not be measured
    │   ├── EngineUnavailable       the measurement engine does not answer / did not start
    │   └── ReloadRejected          the engine refused a compiled config (HTTP 4xx)
    ├── VerificationFailed          a candidate's greedy outputs differ from the reference
    └── PromotionError              a live worker could not take the winner (or cannot hot-reload)

Bad *lines* in a trace are not errors: they are reported with their line
numbers and skipped (see :mod:`optimizer.profile`).
"""

from __future__ import annotations


class OptimizerError(Exception):
    """Base class of optimizer errors."""


class TraceError(OptimizerError):
    """A trace file cannot be opened or read."""


class SpaceError(OptimizerError):
    """A point is outside the search space or breaks one of its constraints."""


class BoardError(OptimizerError):
    """The SQLite message board cannot be opened or written."""


class MeasurementError(OptimizerError):
    """A candidate config could not be measured."""


class EngineUnavailable(MeasurementError):
    """The measurement engine is not reachable or failed to start."""


class ReloadRejected(MeasurementError):
    """The engine answered /admin/reload with a client error: the config is not applicable."""


class VerificationFailed(OptimizerError):
    """A candidate changed greedy outputs or showed KV-cache contamination."""


class PromotionError(OptimizerError):
    """The winner could not be applied to a live worker."""
