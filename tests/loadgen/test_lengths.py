"""Length policy: scale, then clip, then fit the context — with counts for the report."""

from __future__ import annotations

import pytest

from loadgen.config import LengthConfig
from loadgen.errors import LoadgenConfigError
from loadgen.lengths import LengthStats, describe, fit_lengths


def test_unchanged_by_default() -> None:
    stats = LengthStats()
    assert fit_lengths(4000, 300, LengthConfig(), stats) == (4000, 300)
    assert "unchanged" in describe(LengthConfig(), stats)


def test_context_clips_the_prompt_first() -> None:
    cfg, stats = LengthConfig(max_model_len=2048), LengthStats()
    assert fit_lengths(4000, 300, cfg, stats) == (1748, 300)
    assert fit_lengths(100, 300, cfg, stats) == (100, 300)
    assert fit_lengths(10, 5000, cfg, stats) == (1, 2047)
    assert (stats.num_prompt_clipped, stats.num_output_clipped) == (2, 1)
    assert "2048-token context" in describe(cfg, stats)


def test_scale_then_clip_and_minimums() -> None:
    cfg = LengthConfig(prompt_scale=0.1, output_scale=0.5, max_output_tokens=64,
                       max_prompt_tokens=500)
    stats = LengthStats()
    assert fit_lengths(4808, 10, cfg, stats) == (481, 5)
    assert fit_lengths(9000, 1000, cfg, stats) == (500, 64)
    assert fit_lengths(3, 0, cfg, stats) == (1, 1)
    assert stats.num_raised_to_min == 1 and cfg.scaled_block_tokens == 51
    text = describe(cfg, stats)
    assert "scaled by 0.1 (prefix blocks 512 -> 51 tokens)" in text and "clipped to 64" in text


def test_bad_policies_are_refused() -> None:
    with pytest.raises(LoadgenConfigError, match="prompt_scale"):
        LengthConfig(prompt_scale=0)
    with pytest.raises(LoadgenConfigError, match="max_model_len"):
        LengthConfig(max_model_len=1)
