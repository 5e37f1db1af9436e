"""CSV traces that carry token counts only: Azure LLM inference (2023) and BurstGPT."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

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
    """(line number, row) for every data row; a header without ``required`` is fatal."""
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceLineError(str(path), 1, f"CSV header lacks columns {missing}")
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                bad.reject(TraceLineError(str(path), reader.line_num,
                                          f"expected {len(header)} columns, got {len(row)}"))
                continue
            yield reader.line_num, dict(zip(header, row, strict=True))


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
