"""Fixtures for optimizer tests: a model directory with the bundled tokenizer and a config.json."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from optimizer.engine_proc import free_port
from polyinfer.config import TINY_TARGET, CompiledConfig

TINY_SHAPE = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 768,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 8192, "tie_word_embeddings": True}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The bundled model dir if its weights landed, else its tokenizer + the same config shape."""
    if (TINY_TARGET / "config.json").exists():
        return TINY_TARGET
    d = tmp_path / "tiny-target"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_TARGET / name, d / name)
    (d / "config.json").write_text(json.dumps({**TINY_SHAPE, "model_type": "llama"}))
    return d


def _start_engine(config_path: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "proxy.cli", "--log-level", "WARNING", "engine", "--port",
           str(port), "--config", str(config_path)]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"engine not ready in {timeout_s} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two real engines on the bundled model: (measurement engine URL, live worker URL)."""
    if not (TINY_TARGET / "config.json").exists():
        pytest.fail("the bundled tiny-target weights are missing (models/tiny-target)")
    d = tmp_path_factory.mktemp("engines")
    cfg = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=8192,
                                                             max_model_len=1024)
    path = d / "compiled.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    ports = [free_port(), free_port()]
    procs = [_start_engine(path, p, d / f"engine{i}.log") for i, p in enumerate(ports)]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for proc, url, i in zip(procs, urls, range(2), strict=True):
            _wait_ready(proc, url, d / f"engine{i}.log", 180)
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
