"""Trace readers: one per format, with ``--format auto`` detection."""

from loadgen.readers.base import BadLines, TraceReader
from loadgen.readers.detect import FORMATS, detect_format, read_trace, reader_for

__all__ = ["FORMATS", "BadLines", "TraceReader", "detect_format", "read_trace", "reader_for"]
