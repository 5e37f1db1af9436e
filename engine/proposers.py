"""Build the speculative proposer a compiled config asks for (``engine.spec_method``).

``ngram`` -> :class:`specdec.ngram.NgramProposer`; ``draft`` ->
:class:`specdec.draft.DraftProposer` over :mod:`engine.draft_runner` (a second
:class:`engine.model.LlamaModel` with its own KV cache); ``none`` -> no proposer,
requests decode one token a step.
"""

from __future__ import annotations

import logging

import torch

from engine.checkpoint import ModelSpec
from engine.draft_runner import build_draft_proposer
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
    return build_draft_proposer(cfg)
