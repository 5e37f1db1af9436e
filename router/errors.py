"""Errors raised by the router package.

::

    RouterError (Exception)
    ├── ClassifierArtefactError   the shipped/loaded classifier file is missing or malformed
    └── TrainingDataError         labelled JSONL / trace input is unusable (names file and line)

``router.base.NoWorkerAvailable`` (a ``RuntimeError``) is part of the routing
contract and lives with it.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class for router errors."""


class ClassifierArtefactError(RouterError):
    """The classifier artefact cannot be read or does not match this code's format version."""


class TrainingDataError(RouterError):
    """Training input is unusable; the message names the file, the line and the problem."""
