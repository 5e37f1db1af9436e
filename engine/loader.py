"""Build an :class:`~engine.core.EngineCore` from a compiled config (blocking: run off the loop)."""

from __future__ import annotations

import logging
import time

from engine.checkpoint import load_weights, read_spec
from engine.core import EngineCore
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


def load_core(config: CompiledConfig) -> EngineCore:
    t0 = time.perf_counter()
    spec = read_spec(config.model)
    num_layers = min(config.engine.measure_num_layers or spec.num_layers, spec.num_layers)
    if num_layers < spec.num_layers:
        logger.warning("measure_num_layers=%d: loading %d of %d layers. This model gives WRONG "
                       "outputs and exists only to time steps; never serve it.",
                       num_layers, num_layers, spec.num_layers)
    weights = load_weights(config.model, num_layers)
    tokenizer = TextTokenizer(config.model, spec.eos_token_ids)
    core = EngineCore(config, spec, weights, tokenizer)
    logger.info("engine loaded %s in %.2f s", config.model, time.perf_counter() - t0)
    return core
