"""The trace-reader role and the bad-line policy every reader shares.

A reader turns one file into :class:`~loadgen.request.TraceRequest` records,
in file order. It never guesses around a malformed line: it raises
:class:`~loadgen.errors.TraceLineError` for that line through
:meth:`BadLines.reject`, which either re-raises (``--bad-lines fatal``) or logs
the line number and counts it (``--bad-lines skip``). Nothing is silently
mis-timed: a line whose timestamp cannot be read is rejected, never given a
made-up arrival time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from loadgen.errors import LoadgenConfigError, TraceLineError
from loadgen.request import TraceRequest

logger = logging.getLogger(__name__)

BAD_LINE_POLICIES = ("skip", "fatal")
MAX_LOGGED_BAD_LINES = 20  # log the first few individually, then only count
# NOTE: beyond any model's context (the longest are ~10M tokens); a larger length is a
# corrupt field, and synthesising a prompt that long would never finish.
MAX_TOKENS = 1 << 24


@dataclass
class BadLines:
    """Collects (or raises) malformed lines for one read."""

    policy: Literal["skip", "fatal"] = "skip"
    num_bad: int = 0
    first: list[str] = field(default_factory=list)  # "path:line: reason", first few

    def __post_init__(self) -> None:
        if self.policy not in BAD_LINE_POLICIES:
            raise LoadgenConfigError(f"bad_lines: expected one of {BAD_LINE_POLICIES}, "
                                     f"got {self.policy!r}")

    def reject(self, error: TraceLineError) -> None:
        if self.policy == "fatal":
            raise error
        self.num_bad += 1
        if len(self.first) < MAX_LOGGED_BAD_LINES:
            self.first.append(str(error))
            logger.warning("skipping bad trace line %s", error)


class TraceReader(Protocol):
    """Reads one trace format. ``sniff`` looks at the first non-empty line only."""

    name: str

    def sniff(self, first_line: str) -> bool:
        """True when ``first_line`` looks like this format."""
        ...

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        """Yield the file's records in order; report malformed ones to ``bad``."""
        ...


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, stripped line) for every non-blank line.

    A leading UTF-8 byte-order mark is dropped. Bytes that are not UTF-8 are
    kept as lone surrogates (``surrogateescape``), which the JSON parser
    rejects, so such a line is reported as bad instead of having its text
    silently altered.
    """
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.strip()
            if line:
                yield number, line


def first_line(path: Path) -> str:
    for _, line in numbered_lines(path):
        return line
    return ""


def non_negative_int(value: object, key: str) -> int:
    """A token count (int in 0..MAX_TOKENS) from a JSON/CSV value, or ValueError naming the key."""
    number = value
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, str):
        try:
            number = int(number.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"{key}: expected a non-negative integer, got {value!r}")
    if number > MAX_TOKENS:
        raise ValueError(f"{key}: {number} tokens is beyond {MAX_TOKENS}; a corrupt value?")
    return number


def finite_float(value: object, key: str) -> float:
    if isinstance(value, bool):  # float(True) is 1.0: a flag is not a time
        raise ValueError(f"{key}: expected a number, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return number
