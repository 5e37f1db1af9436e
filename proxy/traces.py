"""Trace writer: one JSONL record per request, off the request path, in rotating files.

When a request has finished (its response is complete), its record is
serialised (orjson, a few microseconds) and the line appended to a list. A
background task swaps the list out every ``flush_interval_s`` (or sooner when
``batch_size`` lines are pending) and a worker thread appends them to the file.

NOTE: serialising in the worker thread instead held the GIL for a whole batch
(~500 records, a few ms at 1,000 req/s) while the event loop waited for it:
a latency spike every flush. File writes release the GIL; Python code doesn't.

Files are ``traces-<start time>-<n>.jsonl`` in ``dir``; past ``max_bytes`` a
new file starts and files beyond ``max_files`` are deleted,
oldest first. ``close()`` flushes everything still pending.

A directory that cannot be written is a start-up error (:meth:`TraceWriter.check_writable`);
records lost later (a full disk, a directory removed) are counted in ``num_failed``, shown
in ``/stats`` and in ``/metrics`` (:class:`TraceCollector`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import orjson
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.config import TraceConfig
from proxy.record import RequestRecord

logger = logging.getLogger(__name__)


class RotatingJsonl:
    """Appends lines to size-rotated files; used from one thread at a time."""

    def __init__(self, directory: Path, max_bytes: int, max_files: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._stamp = time.strftime("%Y%m%d-%H%M%S")
        self._index = 0
        self._file: IO[bytes] | None = None
        self._size = 0

    def write(self, lines: list[bytes]) -> None:
        for line in lines:
            if self._file is None or self._size >= self.max_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(line)
            self._size += len(line)
        if self._file is not None:
            self._file.flush()

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"traces-{self._stamp}-{self._index:04d}.jsonl"
        self._index += 1
        self._file = open(path, "ab")  # noqa: SIM115 (kept open across batches)
        self._size = self._file.tell()
        self._prune()

    def _prune(self) -> None:
        files = sorted(self.directory.glob("traces-*.jsonl"))  # names sort by start time, index
        for old in files[:-self.max_files]:
            with contextlib.suppress(OSError):
                old.unlink()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TraceWriter:
    """Collects finished request records and writes them in batches from a thread."""

    def __init__(self, config: TraceConfig, directory: Path) -> None:
        self.config = config
        self._out = RotatingJsonl(directory, config.max_bytes, config.max_files)
        self._pending: list[bytes] = []  # serialised JSONL lines
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_written = 0
        self.num_dropped = 0
        self.num_failed = 0  # records lost to write errors
        self._failing = False
        self._closing = False
        self._io_lock = threading.Lock()  # a cancelled flush's thread may still be writing

    def append(self, rec: RequestRecord) -> None:
        pending = self._pending
        if len(pending) >= self.config.max_pending:
            self.num_dropped += 1  # the disk is not keeping up; memory stays bounded
            return
        pending.append(orjson.dumps(rec.to_trace(), option=orjson.OPT_APPEND_NEWLINE))
        if len(pending) >= self.config.batch_size:
            self._wake.set()

    def check_writable(self) -> None:
        """Raise :class:`OSError` naming the directory unless a file can be written there.

        Blocking (a few file-system calls): start-up only."""
        directory = self._out.directory
        probe = directory / f".write-check-{os.getpid()}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise OSError(e.errno, f"traces.dir {str(directory)!r}: cannot write trace files "
                                   f"there ({e.strerror or e}); make it writable, point "
                                   "traces.dir elsewhere, or set traces.enabled: false") from None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="trace-writer")

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.flush_interval_s)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            # NOTE: shielded: cancelling a to_thread call whose thread has not started yet
            # cancels the call, and the batch, already out of _pending, would be lost
            await asyncio.shield(asyncio.to_thread(self._write, batch))
        except OSError as e:
            self.num_failed += len(batch)
            if not self._failing:  # NOTE: once per failing spell, not once per flush
                logger.error("trace writes failing, records lost (counted in /stats "
                             "traces.failed): %s", e)
            self._failing = True
            return
        if self._failing:
            logger.warning("trace writes work again; %d records were lost", self.num_failed)
            self._failing = False

    def _write(self, lines: list[bytes]) -> None:
        with self._io_lock:
            self._out.write(lines)
            self.num_written += len(lines)

    def _close_file(self) -> None:
        with self._io_lock:
            self._out.close()

    async def close(self) -> None:
        """Flush every record appended so far and close the file.

        NOTE: the task is stopped, not cancelled: it may be flushing a batch it has taken
        (the drain's cut requests' records, lost once when cancelling it here)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self.flush()
        await asyncio.to_thread(self._close_file)


class TraceCollector(Collector):
    """``polyinfer_trace_records_total{outcome}``: written, dropped (the disk was not keeping
    up), failed (write errors)."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("polyinfer_trace_records", "Trace records by outcome",
                                     labels=["outcome"])
        w = self.writer
        for outcome, value in (("written", w.num_written), ("dropped", w.num_dropped),
                               ("failed", w.num_failed)):
            family.add_metric([outcome], value)
        yield family
