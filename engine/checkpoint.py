"""Read a Hugging Face Llama/Qwen2 checkpoint directory: its shape and its weights.

Only ``config.json`` and ``*.safetensors`` are read (no ``transformers``
import). Weights are kept exactly as stored on disk (usually bf16): the model
casts them to the serving dtype, so a hot reload can re-cast from this
in-memory copy without touching the disk again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.errors import CheckpointError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"llama": False, "qwen2": True}  # model_type -> q/k/v projections carry a bias


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only Llama-family model, from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = ()  # from config.json / generation_config.json

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads ({self.num_heads}) must be a multiple "
                                  f"of num_key_value_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope_theta(cfg: dict[str, Any], where: Path) -> float:
    # transformers >= 5 nests RoPE settings in rope_parameters; older files use top-level keys.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise CheckpointError(f"{where}: RoPE scaling {rope_type!r} is not supported "
                              f"(only unscaled RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def read_spec(model_dir: str | Path) -> ModelSpec:
    """Parse ``config.json`` (and ``generation_config.json`` if present) into a ModelSpec."""
    where = Path(model_dir) / "config.json"
    if not where.parent.is_dir():
        raise CheckpointError(f"model directory {where.parent} does not exist; give a "
                              "checkpoint directory (the config's model / engine.draft_model, "
                              "or --model)")
    try:
        cfg = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: cannot read model config: {e}") from e
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported; expected "
                              f"one of {sorted(SUPPORTED_ARCHS)}")
    gen_path = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg, where),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHS[model_type] or bool(cfg.get("attention_bias", False)),
            eos_token_ids=_eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id"))),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e}") from e


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def _wanted(name: str, num_layers: int) -> bool:
    if not name.startswith("model.layers."):
        return True
    return int(name.split(".")[2]) < num_layers


def load_weights(model_dir: str | Path, num_layers: int) -> dict[str, torch.Tensor]:
    """Tensors of the first ``num_layers`` layers plus embeddings/norm/head, in on-disk dtype."""
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(model_dir)):
        try:
            shard = load_file(str(path))
        except Exception as e:  # safetensors raises its own and OSError
            raise CheckpointError(f"{path}: cannot read weights: {e}") from e
        weights.update({k: v for k, v in shard.items() if _wanted(k, num_layers)})
    logger.info("loaded %d tensors from %s", len(weights), model_dir)
    return weights
