"""Optimizer settings from a file: what a host leaves to the operator.

``polyinfer serve --optimize`` builds one :class:`optimizer.service.OptimizerConfig`
per tuned worker; the fields that say *which* worker and *whose* traffic
(:data:`HOST_FIELDS`) come from the proxy's ``optimize`` section, and the rest
(tiers, search budget, promotion and canary, verification, the search space's
knobs, a persistent measurement engine...) from an optional settings file named
by ``optimize.settings``, checked key by key like every polyinfer config::

    # optimizer.yaml
    search: {fast_budget: 8, max_pairs: 6}
    promotion: {watch_s: 5, canary: {min_samples: 10}}
    knobs:
      - {name: max_num_seqs, values: [4, 8, 16, 32]}
      - {name: spec_method, values: [none, ngram]}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer.errors import OptimizerError
from optimizer.service import OptimizerConfig
from polyinfer.config import ConfigError, build_dataclass, load_mapping

HOST_FIELDS = ("base", "traces", "board_path", "worker_url", "worker_name", "worker_backend",
               "agents", "llm_url", "llm_model", "min_records", "once")


def load_settings(path: str | Path) -> Mapping[str, Any]:
    """The settings file's mapping, refused if it sets a field the host owns."""
    try:
        data = load_mapping(Path(path))
    except (OSError, ConfigError) as e:
        raise OptimizerError(f"optimize.settings: cannot read {path}: {e}") from e
    if not isinstance(data, Mapping):
        raise OptimizerError(f"optimize.settings: {path} is not a mapping")
    owned = sorted(set(data) & set(HOST_FIELDS))
    if owned:
        raise OptimizerError(f"optimize.settings: {owned} are set by the proxy's optimize "
                             "section, not the settings file")
    return data


def build_config(settings: Mapping[str, Any], **host: Any) -> OptimizerConfig:
    """An OptimizerConfig: ``settings`` checked as the file's keys, then the host's fields."""
    unknown = sorted(set(host) - set(HOST_FIELDS))
    if unknown:
        raise OptimizerError(f"host fields: unexpected {unknown}; expected some of {HOST_FIELDS}")
    try:
        # NOTE: built with the host's defaults first, so a settings file alone is checked
        # (an agent list needing an llm_url is the host's to validate below)
        cfg = build_dataclass(OptimizerConfig, dict(settings), "optimize.settings")
    except (ConfigError, ValueError) as e:
        raise OptimizerError(str(e)) from e
    return dataclasses.replace(cfg, **host)
