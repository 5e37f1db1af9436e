"""Format registry and ``--format auto`` detection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loadgen.errors import TraceError, TraceFormatError
from loadgen.readers.base import BadLines, TraceReader, first_line
from loadgen.readers.csv_traces import AzureCsvReader, BurstGptCsvReader
from loadgen.readers.json_traces import MooncakeReader, PolyinferTraceReader
from loadgen.readers.prompts import JsonlPromptsReader, ShareGptReader, SpecBenchReader
from loadgen.request import TraceRequest

# NOTE: order matters for auto detection: the most specific signatures first
# (a polyinfer record may also carry a "prompt" key).
READERS: tuple[TraceReader, ...] = (
    PolyinferTraceReader(), MooncakeReader(), SpecBenchReader(), ShareGptReader(),
    AzureCsvReader(), BurstGptCsvReader(), JsonlPromptsReader(),
)
FORMATS: tuple[str, ...] = ("auto", *(r.name for r in READERS))


def reader_for(name: str) -> TraceReader:
    for reader in READERS:
        if reader.name == name:
            return reader
    raise TraceFormatError(f"unknown trace format {name!r}; expected one of {FORMATS}")


def detect_format(path: str | Path) -> str:
    """The name of the first reader whose signature matches the file's first line."""
    path = Path(path)
    line = first_line(path)
    for reader in READERS:
        if reader.sniff(line):
            return reader.name
    raise TraceFormatError(f"{path}: cannot detect the trace format from its first line "
                           f"{line[:120]!r}; pass --format, one of {FORMATS[1:]}")


def read_trace(path: str | Path, fmt: str = "auto", bad: BadLines | None = None
               ) -> Iterator[TraceRequest]:
    """Records of ``path`` in file order, read with ``fmt`` (or the detected format)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    name = detect_format(path) if fmt == "auto" else fmt
    return reader_for(name).read(path, bad if bad is not None else BadLines())
