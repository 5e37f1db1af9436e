"""CSV traces that carry token counts only: Azure LLM inference (2023) and BurstGPT."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadgen.errors import TraceLineError
from loadgen.readers.base import BadLines, finite_float, non_negative_int
from loadgen.request import TraceRequest


def parse_azure_timestamp(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits, UTC) -> unix seconds.

    NOTE: parsed by hand because ``datetime`` keeps only microseconds and
    Python 3.11's ``fromisoformat`` rejects 7 digits.
    """
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    if frac and not frac.isdigit():
        raise ValueError(f"TIMESTAMP: bad fraction in {text!r}")
    return base.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _csv_rows(path: Path, bad: BadLines, required: tuple[str, ...]
              ) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) for every data row; a header without ``required`` is fatal.

    So is a row the ``csv`` module cannot parse (a stray quote that runs past the
    field size limit): it cannot resynchronise, so nothing after it can be trusted.
    """
    # NOTE: utf-8-sig: spreadsheet exports start with a byte-order mark, which would
    # otherwise become part of the first column's name.
    with path.open(encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        rows = _parsed(reader, path)
        header = [h.strip() for h in next(rows, [])]
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceLineError(str(path), 1, f"CSV header lacks columns {missing}")
        for row in rows:
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                bad.reject(TraceLineError(str(path), reader.line_num,
                                          f"expected {len(header)} columns, got {len(row)}"))
                continue
            yield reader.line_num, dict(zip(header, row, strict=True))


def _parsed(reader: Any, path: Path) -> Iterator[list[str]]:
    """``reader``'s rows, with a ``csv.Error`` turned into a line error for ``path``."""
    while True:
        start = reader.line_num + 1  # the row being read starts on the next line
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceLineError(str(path), start, f"CSV row starting here cannot be parsed "
                                 f"({e}); a stray quote?") from e
        yield row


class AzureCsvReader:
    """Azure LLM inference trace: ``TIMESTAMP,ContextTokens,GeneratedTokens``."""

    name = "azure"
    columns = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

    def sniff(self, first_line: str) -> bool:
        return all(c in first_line for c in self.columns)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, row in _csv_rows(path, bad, self.columns):
            try:
                yield TraceRequest(
                    line=line,
                    timestamp_s=parse_azure_timestamp(row["TIMESTAMP"]),
                    prompt_tokens=non_negative_int(row["ContextTokens"], "ContextTokens"),
                    output_tokens=non_negative_int(row["GeneratedTokens"], "GeneratedTokens"),
                )
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))


class BurstGptCsvReader:
    """BurstGPT: ``Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,...``.

    ``Timestamp`` is seconds since the start of the trace. Rows with 0 response
    tokens are failed requests in the original service; they are kept (the
    load they put on the server was real) and the length policy's
    ``min_output_tokens`` decides what they ask for.
    """

    name = "burstgpt"
    columns = ("Timestamp", "Request tokens", "Response tokens")

    def sniff(self, first_line: str) -> bool:
        return all(c in first_line for c in self.columns)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, row in _csv_rows(path, bad, self.columns):
            try:
                yield TraceRequest(
                    line=line,
                    timestamp_s=finite_float(row["Timestamp"], "Timestamp"),
                    prompt_tokens=non_negative_int(row["Request tokens"], "Request tokens"),
                    output_tokens=non_negative_int(row["Response tokens"], "Response tokens"),
                )
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))
