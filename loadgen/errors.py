"""Errors raised by loadgen.

The tree::

    LoadgenError                  base of everything loadgen raises on purpose
    ├── LoadgenConfigError        a config value or command-line option is invalid
    ├── TraceError                a trace file cannot be used
    │   ├── TraceFormatError      --format auto cannot tell the format, or it is unknown
    │   └── TraceLineError        one line is malformed (carries path and line number);
    │                             fatal under --bad-lines fatal, logged and skipped otherwise
    ├── TokenizerError            a --tokenizer path cannot be loaded
    └── TargetError               the target server cannot be used (no model, unreachable)

Per-request failures (HTTP errors, timeouts, broken streams) are not raised:
they are measured and end up in the ``error`` field of the request record.
"""

from __future__ import annotations


class LoadgenError(Exception):
    """Base of every error loadgen raises on purpose."""


class LoadgenConfigError(LoadgenError, ValueError):
    """A config value or command-line option is invalid; the message names it."""


class TraceError(LoadgenError):
    """A trace file cannot be used."""


class TraceFormatError(TraceError):
    """The trace format is unknown or cannot be detected."""


class TraceLineError(TraceError):
    """One line (or record) of a trace is malformed."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line  # 1-based line number (record number for JSON arrays)
        self.reason = reason


class TokenizerError(LoadgenError):
    """A tokenizer path cannot be loaded."""


class TargetError(LoadgenError):
    """The target server cannot be used."""
