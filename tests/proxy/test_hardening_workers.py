"""Launched workers die with their proxy, however it ends (issue 30): a real `polyinfer
serve` process with a supervised engine worker, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from polyinfer.config import TINY_TARGET
from proxy.supervisor import WORKER_MARK_ENV, free_port, stop_leftover
from tests.proxy.servers import wait_healthy

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serve(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    config = {"server": {"host": "127.0.0.1", "port": port},
              "workers": [{"name": "solo", "launch": {},
                           "config": {"backend": "engine", "model": str(TINY_TARGET),
                                      "engine": {"max_num_seqs": 2,
                                                 "kv_cache_tokens": 2048}}}],
              "auth": {"admin_key": "adm"}, "traces": {"dir": str(tmp_path / "traces")},
              "run_dir": str(tmp_path / "run")}
    path = tmp_path / "polyinfer.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
                            stdout=open(tmp_path / "proxy.log", "ab"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)


def _worker_pid(url: str) -> int:
    r = httpx.get(url + "/admin/workers", headers={"x-admin-key": "adm"}, timeout=10)
    return int(r.json()["workers"][0]["pid"])


def test_a_killed_proxy_takes_its_workers_with_it(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy = _serve(tmp_path, port)
    try:
        wait_healthy(url, timeout_s=240, proc=proxy)
        worker = _worker_pid(url)
        assert _alive(worker)
        proxy.send_signal(signal.SIGKILL)
        proxy.wait(10)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived its proxy"
        # a restarted proxy on the same run directory: one worker, no orphan beside it
        proxy = _serve(tmp_path, port)
        wait_healthy(url, timeout_s=240, proc=proxy)
        assert _worker_pid(url) != worker
    finally:
        proxy.terminate()
        proxy.wait(60)


def test_a_leftover_worker_is_stopped_by_its_pid_file(tmp_path: Path) -> None:
    """Where the parent-death signal is missing (or the worker ignores it), the next
    proxy's start stops the process its pid file names, and only that one."""
    mark = str(tmp_path / "configs" / "w.yaml")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                               env={**os.environ, WORKER_MARK_ENV: mark},
                               start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                start_new_session=True)
    try:
        pid_file = tmp_path / "w.pid"
        pid_file.write_text(f"{stranger.pid}\n{mark}\n")
        stop_leftover(pid_file)  # a pid that is not the worker: left alone
        time.sleep(0.3)
        assert stranger.poll() is None
        pid_file.write_text(f"{sleeper.pid}\n{mark}\n")
        stop_leftover(pid_file)
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        for p in (sleeper, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()
