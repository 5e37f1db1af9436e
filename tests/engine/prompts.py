"""Real prompts for engine tests: Spec-Bench questions across categories (../shared/data)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import REPO_ROOT

SPEC_BENCH = REPO_ROOT.parent / "shared" / "data" / "prompts" / "spec_bench_questions.jsonl"
FALLBACK = [  # used only when the shared data is not mounted
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23? Explain step by step.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Translate to German: Good morning, how are you today?",
]


def mixed_prompts(n: int) -> list[str]:
    """``n`` first-turn prompts, round-robin over categories, deterministic."""
    if not Path(SPEC_BENCH).exists():
        return [FALLBACK[i % len(FALLBACK)] + f" ({i})" for i in range(n)]
    by_cat: dict[str, list[str]] = {}
    for line in Path(SPEC_BENCH).read_text().splitlines():
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
