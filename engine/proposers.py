"""Build the speculative proposer a compiled config asks for (``engine.spec_method``).

``ngram`` -> :class:`specdec.ngram.NgramProposer`; ``draft`` -> the draft-model
proposer from ``specdec.draft`` (which runs a second :class:`engine.model.LlamaModel`
with its own KV cache); ``none`` -> no proposer, requests decode one token a step.
"""

from __future__ import annotations

import importlib
import logging

import torch

from engine.checkpoint import ModelSpec
from engine.errors import ReloadError
from polyinfer.config import EngineConfig
from specdec.base import Proposer
from specdec.ngram import NgramConfig, NgramProposer

logger = logging.getLogger(__name__)


def build_proposer(cfg: EngineConfig, spec: ModelSpec,
                   weights: dict[str, torch.Tensor]) -> Proposer | None:
    if cfg.spec_method == "none" or cfg.spec_max_depth == 0:
        return None
    if cfg.spec_method == "ngram":
        if cfg.ngram_capped:
            return NgramProposer(NgramConfig(min_n=cfg.ngram_min, max_n=cfg.ngram_max))
        return NgramProposer(NgramConfig(min_n=cfg.ngram_min, max_n=cfg.ngram_max,
                                         weak_match_depth=None, context_depth_caps=(),
                                         pool_depth_caps=()))
    return _draft_proposer(cfg)


def _draft_proposer(cfg: EngineConfig) -> Proposer:
    try:
        module = importlib.import_module("specdec.draft")
        factory = module.build_draft_proposer
    except (ImportError, AttributeError) as e:
        raise ReloadError("spec_method 'draft' needs specdec.draft.build_draft_proposer, "
                          f"which is not available: {e}") from e
    proposer: Proposer = factory(cfg)
    return proposer
