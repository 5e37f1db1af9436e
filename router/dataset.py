"""The default training / held-out split for the domain classifier.

``build_default(data_dir)`` reads the shared data directory (Spec-Bench,
GSM8K) plus this interpreter's standard library, splits by group
(:func:`router.corpus.is_held_out`) and then adds template examples filled
only from the training side. Held out (no router.templates examples):

- Spec-Bench: half of the question ids of every category;
- GSM8K: 20% of the rows read;
- stdlib code requests: 25% of the modules (whole modules).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from router import templates
from router.corpus import Example, gsm8k, is_held_out, spec_bench, stdlib_code

HELD_OUT = {"spec_bench": 0.5, "gsm8k": 0.2, "stdlib": 0.25}


@dataclass(frozen=True)
class Split:
    train: list[Example]
    test: list[Example]


def split(examples: list[Example]) -> Split:
    train: list[Example] = []
    test: list[Example] = []
    for ex in examples:
        frac = HELD_OUT.get(ex.source, 0.0)
        (test if is_held_out(ex.group, frac) else train).append(ex)
    return Split(train, test)


def build_default(data_dir: Path, gsm8k_rows: int = 2500, seed: int = 0) -> Split:
    prompts = data_dir / "prompts"
    real = [*spec_bench(prompts / "spec_bench_questions.jsonl"),
            *gsm8k(prompts / "gsm8k_train.jsonl", gsm8k_rows),
            *stdlib_code()]
    base = split(real)
    rng = random.Random(seed)
    train = list(base.train) + _templated(base.train, rng)
    rng.shuffle(train)
    return Split(train, base.test)


def _templated(train: list[Example], rng: random.Random) -> list[Example]:
    sb = [e for e in train if e.source == "spec_bench"]
    articles = [e.text.removeprefix("Summarize: ") for e in sb if e.domain == "summarization"]
    contexts = [e.text.rsplit("\n", 1)[0] for e in sb if e.domain == "rag"]
    questions = [e.text for e in sb if e.domain == "qa" and len(e.text) < 200]
    sentences = [e.text.split(". ")[0] for e in train if e.source == "gsm8k"]
    out = list(templates.chat(rng, 400))
    out += templates.qa(rng, 250)
    out += templates.code_and_math(rng, 150)
    out += templates.from_passages(articles + contexts, sentences, rng, 250)
    out += templates.rag(articles, questions, rng, 150)
    return out
