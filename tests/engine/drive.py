"""Drive an EngineCore to completion in-process (no server): the outputs the tests compare."""

from __future__ import annotations

from typing import Any

from engine.sequence import GenerationParams


def generate(core: Any, prompts: list[list[int]], params: list[GenerationParams],
             cached: dict[str, int] | None = None) -> tuple[list[list[int]], int, int]:
    """Outputs per prompt, drafted and accepted token counts; ``cached`` gets each
    request's prompt tokens served from the prefix cache."""
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", ids, p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    drafted = accepted = 0
    for _ in range(5000):
        if not core.has_work:
            break
        outputs, stats = core.step()
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
            if cached is not None:
                cached[o.request_id] = o.num_cached_tokens
    assert not core.has_work
    return [out[f"r{i}"] for i in range(len(prompts))], drafted, accepted
