"""Fitting recorded lengths to the target: scale, then clip (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.config import LengthConfig


@dataclass
class LengthStats:
    """What the length policy did, for the report."""

    num_requests: int = 0
    num_prompt_scaled: int = 0
    num_output_scaled: int = 0
    num_prompt_clipped: int = 0  # by max_prompt_tokens or max_model_len
    num_output_clipped: int = 0  # by max_output_tokens or max_model_len
    num_raised_to_min: int = 0  # zero-length prompt/output raised to the minimum

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


def fit_lengths(prompt_tokens: int, output_tokens: int, cfg: LengthConfig,
                stats: LengthStats) -> tuple[int, int]:
    """(prompt, output) after scaling, clipping and the context limit.

    >>> fit_lengths(4000, 300, LengthConfig(max_model_len=2048), LengthStats())
    (1748, 300)
    """
    stats.num_requests += 1
    prompt, output = prompt_tokens, output_tokens
    if cfg.prompt_scale != 1.0:
        prompt = round(prompt * cfg.prompt_scale)
        stats.num_prompt_scaled += 1
    if cfg.output_scale != 1.0:
        output = round(output * cfg.output_scale)
        stats.num_output_scaled += 1
    if prompt < cfg.min_prompt_tokens or output < cfg.min_output_tokens:
        stats.num_raised_to_min += 1
        prompt, output = max(prompt, cfg.min_prompt_tokens), max(output, cfg.min_output_tokens)
    if cfg.max_output_tokens is not None and output > cfg.max_output_tokens:
        output = cfg.max_output_tokens
        stats.num_output_clipped += 1
    if cfg.max_model_len is not None and output > cfg.max_model_len - cfg.min_prompt_tokens:
        output = cfg.max_model_len - cfg.min_prompt_tokens
        stats.num_output_clipped += 1
    limit = cfg.max_prompt_tokens
    if cfg.max_model_len is not None:
        room = cfg.max_model_len - output
        limit = room if limit is None else min(limit, room)
    if limit is not None and prompt > limit:
        prompt = limit
        stats.num_prompt_clipped += 1
    return prompt, output


def describe(cfg: LengthConfig, stats: LengthStats) -> str:
    """One sentence for the report: what was done to the recorded lengths."""
    if not cfg.changes_lengths and not stats.num_raised_to_min:
        return "Recorded prompt and output lengths were replayed unchanged."
    done = []
    if cfg.prompt_scale != 1.0:
        done.append(f"prompt lengths scaled by {cfg.prompt_scale:g} (prefix blocks "
                    f"{cfg.block_tokens} -> {cfg.scaled_block_tokens} tokens)")
    if cfg.output_scale != 1.0:
        done.append(f"output lengths scaled by {cfg.output_scale:g}")
    if cfg.max_prompt_tokens is not None:
        done.append(f"prompts clipped to {cfg.max_prompt_tokens} tokens")
    if cfg.max_output_tokens is not None:
        done.append(f"outputs clipped to {cfg.max_output_tokens} tokens")
    if cfg.max_model_len is not None:
        done.append(f"prompt + output clipped to the {cfg.max_model_len}-token context")
    return ("; ".join(done).capitalize() + "." if done else "") + (
        f" {stats.num_prompt_clipped} of {stats.num_requests} prompts and "
        f"{stats.num_output_clipped} outputs were clipped; {stats.num_raised_to_min} "
        f"zero lengths were raised to the minimum ({cfg.min_prompt_tokens}/"
        f"{cfg.min_output_tokens}).")
