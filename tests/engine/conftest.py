"""Fixtures for the engine tests: small checkpoints and one real engine server per module."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from polyinfer.config import TINY_DRAFT, TINY_TARGET
from proxy.supervisor import free_port

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_random_checkpoint(out: Path, model_type: str = "llama", **shape: int) -> Path:
    """A random-init HF checkpoint (bf16 on disk, like the bundled one) + the bundled tokenizer."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=2048, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=2)
    common.update(shape)
    if model_type == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TINY_TARGET / name).exists():
            shutil.copy(TINY_TARGET / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny-target when its weights exist, else a random one of the same shape."""
    if (TINY_TARGET / "model.safetensors").exists():
        return TINY_TARGET
    return save_random_checkpoint(tmp_path_factory.mktemp("tiny-target"))


class EngineProcess:
    """A real `python -m engine` server on loopback, started from a compiled config."""

    def __init__(self, config: dict, workdir: Path, log_level: str = "WARNING") -> None:
        import subprocess
        import sys

        import yaml

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        path = workdir / "engine.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(workdir / "engine.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "--config", str(path), "--port", str(self.port),
             "--log-level", log_level], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("engine did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
        self.log.close()


def draft_engine_config(model_dir: Path) -> dict:
    """An engine with the bundled draft model (sampled drafts, prefix caching on), served as
    ``tiny``: what the API tests run against, so speculation is always in the path.

    On the CPU by default; ``POLYINFER_TEST_DEVICE=cuda`` (with
    ``POLYINFER_TEST_EXECUTION=eager|cuda_graph``, default eager) runs the same tests on a
    GPU."""
    return {"backend": "engine", "model": str(model_dir), "served_model_name": "tiny",
            "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256,
                       "kv_cache_tokens": 8192, "max_model_len": 2048,
                       "spec_method": "draft", "draft_model": str(TINY_DRAFT),
                       "spec_max_depth": 4, "enable_prefix_caching": True,
                       "device": os.environ.get("POLYINFER_TEST_DEVICE", "cpu"),
                       "execution": os.environ.get("POLYINFER_TEST_EXECUTION", "eager")}}


def serving(config: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A module fixture's engine: ``config`` served until the module's tests are done."""
    proc = EngineProcess(config, tmp_path_factory.mktemp("engine"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine per test module: ngram speculation available, small but real limits."""
    config = {"backend": "engine", "model": str(tiny_model_dir), "served_model_name": "tiny",
              "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256,
                         "kv_cache_tokens": 8192, "max_model_len": 2048,
                         "spec_method": "ngram", "spec_max_depth": 4}}
    yield from serving(config, tmp_path_factory)
