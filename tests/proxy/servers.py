"""Test servers on loopback: real engine workers (subprocesses) and a proxy in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import uvloop

from proxy.config import (
    HealthConfig,
    LaunchSpec,
    LimitsConfig,
    ProxyConfig,
    ServerConfig,
    TraceConfig,
    WorkerSpec,
    default_config,
)
from proxy.server import ProxyServer
from proxy.supervisor import engine_command, free_port


def wait_healthy(url: str, timeout_s: float = 240.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.25)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


@dataclasses.dataclass
class EngineProcess:
    spec: WorkerSpec
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def engine_processes(run_dir: Path) -> Iterator[list[EngineProcess]]:
    """The embedded default's two engine workers (latency/ngram, throughput), as subprocesses."""
    procs = []
    try:
        for spec in default_config().workers:
            port = free_port()
            cfg = run_dir / f"{spec.name}.yaml"
            import yaml
            cfg.write_text(yaml.safe_dump(spec.config.to_dict()))
            log = open(run_dir / f"{spec.name}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(engine_command(spec, "127.0.0.1", port, cfg), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(EngineProcess(spec, f"http://127.0.0.1:{port}", proc))
        for p in procs:
            wait_healthy(p.url, proc=p.proc)
        yield procs
    finally:
        for p in procs:
            p.stop()


def external_config(engines: list[EngineProcess], tmp: Path, **sections: Any) -> ProxyConfig:
    """A proxy config over already running engines (their compiled configs declared)."""
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": e.spec.name, "url": e.url, "config": e.spec.config.to_dict()}
                    for e in engines],
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        # NOTE: the test machine is shared and noisy: no shedding on loop lag unless asked.
        "limits": {"max_loop_lag_s": 0},
        "run_dir": str(tmp / "run"),
        # NOTE: round-robin, not the default (adaptive): these tests count on every worker
        # getting requests in turn; a test of a policy names it
        "routing": {"policy": "round_robin"},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return ProxyConfig.from_dict(data)


def launched_config(tmp: Path, launch: LaunchSpec, limits: LimitsConfig, health: HealthConfig,
                    workers: tuple[WorkerSpec, ...] | None = None) -> ProxyConfig:
    """The embedded default with its workers (or ``workers``) launched and supervised by
    the proxy: any port, run dir and traces under ``tmp``; round-robin, as in
    :func:`external_config`."""
    base = default_config()
    return dataclasses.replace(
        base, server=ServerConfig(port=0), run_dir=str(tmp / "run"),
        workers=tuple(dataclasses.replace(w, launch=launch) for w in workers or base.workers),
        traces=TraceConfig(dir=str(tmp / "traces"), flush_interval_s=0.1),
        limits=limits, health=health,
        routing=dataclasses.replace(base.routing, policy="round_robin"))


class ProxyThread:
    """A ProxyServer on its own uvloop in a thread, so sync clients can call it."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.server: ProxyServer | None = None
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        self.server = ProxyServer(self.config)
        self.call(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, coro: Any, timeout_s: float = 300.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.stop())
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def app(self) -> Any:
        assert self.server is not None
        return self.server.app


def read_traces(directory: Path) -> list[dict[str, Any]]:
    import orjson
    records = []
    for f in sorted(directory.glob("traces-*.jsonl")):
        records += [orjson.loads(line) for line in f.read_bytes().splitlines() if line]
    return records


def eventually(predicate: Any, timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until true (a streamed request is recorded just after its last byte)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


async def end_other_tasks() -> None:
    """Cancel and await every task of the running loop but the caller: a fake server's
    connection tasks, before its loop stops. NOTE: left pending on a stopped loop, they are
    destroyed whenever the collector finds them, and asyncio logs an ERROR into whatever
    test runs then (one that asserts on its log fails)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def read_raw_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request read by a raw-socket fake upstream: its head and its body (by
    Content-Length; none without)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, (await reader.readexactly(length) if length else b"")


def answer_get(head: bytes) -> bytes | None:
    """A raw-socket fake upstream's answer to a GET (200 ``ok`` for /health, else 404);
    None for any other method."""
    if head.startswith(b"GET /health"):
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    if head.startswith(b"GET"):
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
    return None
