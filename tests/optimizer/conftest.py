"""Fixtures for optimizer tests: a model directory with the bundled tokenizer and a config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import TINY_TARGET

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
