"""Real prompts for engine tests: Spec-Bench questions across categories (data/)."""

from __future__ import annotations

import json
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[2] / "data" / "prompts" / "spec_bench_questions.jsonl"


def mixed_prompts(n: int) -> list[str]:
    """``n`` first-turn prompts, round-robin over categories, deterministic."""
    by_cat: dict[str, list[str]] = {}
    for line in SPEC_BENCH.read_text().splitlines():
        row = json.loads(line)
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    cats = sorted(by_cat)
    out = []
    for i in range(n):
        bucket = by_cat[cats[i % len(cats)]]
        out.append(bucket[(i // len(cats)) % len(bucket)])
    return out


def chat_text(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
