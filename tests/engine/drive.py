"""Drive an EngineCore to completion in-process (no server), and run code under Triton's
CPU interpreter: what the engine tests compare."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine.sequence import GenerationParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a fresh process with Triton's CPU interpreter
    (``TRITON_INTERPRET=1``: it is chosen when Triton is first imported)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                          env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout_s)


def generate(core: Any, prompts: list[list[int]], params: list[GenerationParams],
             cached: dict[str, int] | None = None, texts: dict[str, str] | None = None
             ) -> tuple[list[list[int]], int, int]:
    """Outputs per prompt, drafted and accepted token counts; ``cached`` gets each
    request's prompt tokens served from the prefix cache, ``texts`` its detokenized text."""
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
            if texts is not None:
                texts[o.request_id] = texts.get(o.request_id, "") + o.text
    assert not core.has_work
    return [out[f"r{i}"] for i in range(len(prompts))], drafted, accepted
