"""Fixtures for the engine tests: small checkpoints and one real engine server per module."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.config import TINY_TARGET

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
