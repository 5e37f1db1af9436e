"""Launching and supervising worker processes (engine or vLLM) that the proxy owns.

Each backend has a command builder in :data:`LAUNCH_BUILDERS`; adding a
backend is one more builder. A :class:`SupervisedWorker` writes the compiled
config next to its log in the run directory, starts the child, waits for
``/health``, restarts it with exponential backoff when it dies, and stops it
(SIGTERM, then SIGKILL) on shutdown.

A worker dies with its proxy, however the proxy ends: it starts through a trampoline
that asks the kernel for SIGTERM when the proxy goes (Linux ``PR_SET_PDEATHSIG``) and
exits if the proxy is already gone. Where that is not available, the worker's pid file
(``run_dir/pids/<name>.pid``) lets the next proxy on the same run directory stop a
worker left behind before it starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import yaml

from proxy.config import WorkerSpec

logger = logging.getLogger(__name__)

CommandBuilder = Callable[[WorkerSpec, str, int, Path], list[str]]
WORKER_MARK_ENV = "POLYINFER_WORKER"  # a launched worker's mark: its config file's path


def engine_command(spec: WorkerSpec, host: str, port: int, config_path: Path) -> list[str]:
    """`polyinfer engine` on the compiled config (the built-in engine worker)."""
    return [sys.executable, "-m", "proxy.cli", "engine", "--model", spec.config.model,
            "--host", host, "--port", str(port), "--config", str(config_path),
            *(spec.launch.args if spec.launch else ())]


def vllm_command(spec: WorkerSpec, host: str, port: int, config_path: Path) -> list[str]:
    """vLLM's OpenAI server with the compiled config's `vllm serve` arguments."""
    v = spec.config.vllm
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", spec.config.model, "--host", host, "--port", str(port),
           "--dtype", v.dtype, "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    # NOTE: always: without it vLLM serves the model under its path ("models/tiny-target"),
    # while the proxy routes by model_name ("tiny-target") and every request 404s there.
    extra = [*v.args, *(spec.launch.args if spec.launch else ())]
    if "--served-model-name" not in extra:
        cmd += ["--served-model-name", spec.config.model_name]
    if v.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(v.max_num_batched_tokens)]
    if v.speculative_config:
        cmd += ["--speculative-config", v.speculative_config]
    return cmd + extra


LAUNCH_BUILDERS: dict[str, CommandBuilder] = {"engine": engine_command, "vllm": vllm_command}

# Runs in the child before the worker's command: tie it to the proxy's life, confine it,
# then exec (same pid; the parent-death signal survives exec).
_TRAMPOLINE = ("import os, signal, sys\n"
               "parent, cpus = int(sys.argv[1]), sys.argv[2]\n"
               "try:\n"
               "    import ctypes\n"
               "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)"
               "  # PR_SET_PDEATHSIG\n"
               "except (OSError, AttributeError):\n"
               "    pass  # not Linux: the pid file is what is left\n"
               "if os.getppid() != parent:\n"
               "    sys.exit('the proxy exited before its worker started')\n"
               "if cpus:\n"
               "    cpus = [int(c) for c in cpus.split(',')]\n"
               "    try:\n"
               "        os.sched_setaffinity(0, cpus)\n"
               "    except OSError as e:\n"
               "        sys.exit(f'launch.cpus {cpus}: {e}')\n"
               "os.execvp(sys.argv[3], sys.argv[3:])\n")


def child_command(cmd: list[str], cpus: tuple[int, ...]) -> list[str]:
    """``cmd`` as a child of this process that dies with it (SIGTERM when this process
    goes), confined to ``cpus`` (if any) from its first instruction on.

    NOTE: a trampoline that sets the parent-death signal and its own affinity and execs,
    rather than Popen's preexec_fn (unsafe in a threaded parent), setting it after the
    spawn (racing the child's start-up) or ``taskset`` (not on every host). The signal
    follows the thread that forks the child: the event loop's, alive as long as the proxy.
    """
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()),
            ",".join(map(str, cpus)), *cmd]


def pinned_command(cmd: list[str], cpus: tuple[int, ...]) -> list[str]:
    """``cmd`` confined to ``cpus`` (:func:`child_command`); ``cmd`` as is if empty."""
    return child_command(cmd, cpus) if cpus else cmd


def stop_leftover(pid_path: Path) -> None:
    """Stop the process group a previous proxy's worker left (its pid in ``pid_path``),
    when that process is still that worker (its environment carries the same
    ``POLYINFER_WORKER`` mark: a pid reused by another program is left alone)."""
    try:
        pid_text, marker = pid_path.read_text().split("\n", 1)
        pid = int(pid_text)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return
    if f"{WORKER_MARK_ENV}={marker.strip()}".encode() in environ:
        logger.warning("stopping worker process %d left by an earlier proxy (%s)", pid, pid_path)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def log_tail(path: Path, num_lines: int = 12, max_bytes: int = 64 << 10) -> str:
    """The last ``num_lines`` lines of the worker's latest run in its log ("" if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - max_bytes, 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    text = text.rsplit("\n=== ", 1)[-1]  # this run only: each start writes a "=== " line
    lines = [line for line in text.splitlines()[1:] if line.strip()]
    return "\n".join(lines[-num_lines:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WorkerStartError(RuntimeError):
    """A supervised worker exited or did not become healthy in time."""


class SupervisedWorker:
    """One child worker process: start, readiness wait, restart with backoff, stop."""

    def __init__(self, spec: WorkerSpec, run_dir: Path) -> None:
        assert spec.launch is not None, "only workers with a launch spec are supervised"
        self.spec = spec
        self.launch = spec.launch
        self.host = spec.launch.host
        self.port = spec.launch.port or free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir / "logs" / f"{spec.name}.log"
        self.config_path = run_dir / "configs" / f"{spec.name}.yaml"
        self.pid_path = run_dir / "pids" / f"{spec.name}.pid"
        self.num_restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Start the child and wait until /health answers; then watch it for crashes."""
        await self._spawn()
        await self._wait_ready()
        self._watch_task = asyncio.create_task(self._watch(), name=f"supervise-{self.spec.name}")

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self._terminate(timeout_s)

    async def _spawn(self) -> None:
        builder = LAUNCH_BUILDERS.get(self.spec.backend)
        if builder is None:
            raise WorkerStartError(f"{self.spec.name}: no launcher for backend "
                                   f"{self.spec.backend!r}")
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        stop_leftover(self.pid_path)  # on the same port, or holding the same GPU
        self.config_path.write_text(yaml.safe_dump(self.spec.config.to_dict(), sort_keys=False))
        cmd = child_command(builder(self.spec, self.host, self.port, self.config_path),
                             self.launch.cpus)
        env = {**os.environ, **self.launch.env, WORKER_MARK_ENV: str(self.config_path)}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} start: {' '.join(cmd)}\n"
                      .encode())
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env=env, start_new_session=True)
        self.pid_path.write_text(f"{self._proc.pid}\n{self.config_path}\n")
        logger.info("worker %s started (pid %s) at %s; log %s", self.spec.name, self._proc.pid,
                    self.url, self.log_path)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.launch.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.returncode is not None:
                    code = None if self._proc is None else self._proc.returncode
                    tail = log_tail(self.log_path)
                    raise WorkerStartError(
                        f"{self.spec.name}: exited during start-up (code {code}); the end of "
                        f"{self.log_path}:\n{tail}" if tail else
                        f"{self.spec.name}: exited during start-up (code {code}) with an "
                        f"empty log {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(f"{self.url}/health") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.25)
        raise WorkerStartError(f"{self.spec.name}: not healthy after "
                               f"{self.launch.startup_timeout_s:.0f} s; see {self.log_path}")

    async def _watch(self) -> None:
        backoff = self.launch.restart_backoff_s
        while not self._stopping:
            assert self._proc is not None
            started = time.monotonic()
            code = await self._proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started >= self.launch.stable_after_s:
                backoff = self.launch.restart_backoff_s
            logger.warning("worker %s exited with %s; restarting in %.1f s", self.spec.name,
                           code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.launch.max_backoff_s)
            self.num_restarts += 1
            try:
                await self._spawn()
                await self._wait_ready()
            except (WorkerStartError, OSError) as e:
                logger.error("worker %s restart failed: %s", self.spec.name, e)

    async def _terminate(self, timeout_s: float) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        with contextlib.suppress(OSError):
            self.pid_path.unlink()
        logger.info("worker %s stopped", self.spec.name)
