"""Start and stop a built-in engine worker as a child process (measurement engine, cold restarts).

``polyinfer engine --model DIR --port N --config compiled.yaml`` is the
engine engineer's CLI; this module only launches it, waits for it to answer,
and stops it. The cold start time it measures is what a hot reload avoids.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from optimizer.errors import EngineUnavailable
from optimizer.measure import EngineClient
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds a Linux process has run, all its threads, at nanosecond resolution.

    NOTE: utime/stime in /proc/PID/stat tick at 10 ms, which quantises a
    short replay's tokens-per-CPU-second into steps of several percent; the
    scheduler's per-thread run time (/proc/PID/task/*/schedstat, ns) does not.
    Threads that already exited are not counted there: fine for an engine,
    whose threads live as long as it does (ticks are the fallback).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError as e:
        raise EngineUnavailable(f"cannot read CPU time of process {pid} ({e})") from e
    fields = stat[stat.rindex(")") + 2:].split()  # NOTE: the command name may hold spaces
    ticks_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    run_ns = 0
    for task in tasks:
        try:
            run_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # NOTE: a thread that ended between listing and reading
    return run_ns / 1e9 if run_ns else ticks_s


def child_pids(pid: int) -> list[int]:
    """Direct children of a Linux process (all its threads'), [] when they cannot be read."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue  # NOTE: a thread that ended between listing and reading
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its live descendants (engine-core processes).

    NOTE: with ``data_parallel_size`` N the step loops run in N child
    processes; the HTTP process alone would show a fraction of the work.
    """
    total = process_cpu_seconds(pid)
    for child in child_pids(pid):
        try:
            total += tree_cpu_seconds(child)
        except EngineUnavailable:
            continue  # NOTE: a child that exited between listing and reading
    return total


# python arguments that run the `polyinfer` CLI; a launcher of the same CLI can stand in
# (the verifier's mutation suite runs the engine under tests.optimizer.faults)
ENGINE_LAUNCHER = ("-m", "proxy.cli")


class EngineProcess:
    """One engine child process; ``start()`` returns the seconds until it served."""

    def __init__(self, config: CompiledConfig, port: int | None = None,
                 log_path: str | Path | None = None, nice: int = 0,
                 launcher: tuple[str, ...] = ENGINE_LAUNCHER) -> None:
        self.config = config
        self.launcher = launcher
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else None
        self.nice = nice
        self._proc: asyncio.subprocess.Process | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="polyinfer-opt-engine-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 180.0) -> float:
        cfg_path = Path(self._tmp.name) / "compiled.yaml"
        cfg_path.write_text(yaml.safe_dump(self.config.to_dict()))
        cmd = [sys.executable, *self.launcher, "--log-level", "WARNING", "engine",
               "--model", self.config.model, "--port", str(self.port), "--config", str(cfg_path)]
        if self.nice:
            cmd = ["nice", "-n", str(self.nice), *cmd]
        log = open(self.log_path, "ab") if self.log_path else asyncio.subprocess.DEVNULL
        t0 = time.perf_counter()
        self._proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if self.log_path:
            log.close()  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            ready = asyncio.ensure_future(EngineClient(self.url, session).wait_ready(timeout_s))
            exited = asyncio.ensure_future(self._proc.wait())
            done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
            if exited in done:
                ready.cancel()
                raise EngineUnavailable(f"engine exited with code {self._proc.returncode} during"
                                        f" start-up (log: {self.log_path})")
            exited.cancel()
            ready.result()
        return time.perf_counter() - t0

    def cpu_seconds(self) -> float:
        """CPU seconds the engine has used: all threads, engine-core child processes too."""
        if self._proc is None:
            raise EngineUnavailable("engine not running")
        return tree_cpu_seconds(self._proc.pid)

    async def stop(self, timeout_s: float = 20.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def __aenter__(self) -> EngineProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        self._tmp.cleanup()
