"""Training and evaluation of the domain classifier (offline; never in the request path).

Inputs are :class:`router.corpus.Example` lists from the default corpus
(:mod:`router.dataset`), labelled JSONL or trace files that carry prompt text.
A JSONL line is an object with ``domain`` and one of ``text``, ``prompt`` (a
string), ``prompt_text`` or ``messages`` (OpenAI chat messages) — the last
three are what a trace record holds when the operator stores prompt text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from polyinfer.config import DOMAINS
from router.classifier import DomainClassifier, FeatureConfig, TrainConfig
from router.corpus import Example
from router.errors import TrainingDataError
from router.tokens import message_text

logger = logging.getLogger(__name__)


def load_labelled(path: Path, source: str = "jsonl") -> list[Example]:
    """Read labelled prompts; lines without text or label raise with file:line."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TrainingDataError(f"{path}: cannot read ({e.strerror})") from e
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise TrainingDataError(f"{path}:{num}: not JSON: {e}") from e
        example = _example(row, source, f"{path.name}:{num}")
        if example is None:
            if source == "traces":
                continue  # NOTE: most trace records carry no prompt text; skip them quietly
            raise TrainingDataError(f"{path}:{num}: needs 'domain' in {DOMAINS} and a text field")
        out.append(example)
    return out


def _example(row: Any, source: str, where: str) -> Example | None:
    if not isinstance(row, dict) or row.get("domain") not in DOMAINS:
        return None
    text = _row_text(row)
    if not text:
        return None
    return Example(text, row["domain"], source, str(row.get("group", where)))


def _row_text(row: dict[str, Any]) -> str:
    for key in ("text", "prompt_text", "prompt"):
        if isinstance(row.get(key), str):
            return row[key]
    messages = row.get("messages")
    if isinstance(messages, list):
        return "\n\n".join(message_text(m) for m in messages
                           if isinstance(m, dict) and m.get("role") in ("user", "system"))
    return ""


def train(examples: Sequence[Example], meta: dict[str, object] | None = None,
          features: FeatureConfig | None = None, config: TrainConfig | None = None
          ) -> DomainClassifier:
    if len({e.domain for e in examples}) < 2:
        raise TrainingDataError("training needs examples of at least two domains")
    return DomainClassifier.fit([e.text for e in examples], [e.domain for e in examples],
                                features, config, meta)


def evaluate(clf: DomainClassifier, examples: Iterable[Example]) -> dict[str, Any]:
    """Per-domain precision/recall/F1, macro-F1 and support on ``examples``."""
    from sklearn.metrics import precision_recall_fscore_support

    examples = list(examples)
    y_true = [e.domain for e in examples]
    y_pred = [clf.predict(e.text) for e in examples]
    labels = sorted(set(y_true))
    p, r, f, s = precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    per = {d: {"precision": round(float(p[i]), 3), "recall": round(float(r[i]), 3),
               "f1": round(float(f[i]), 3), "support": int(s[i])} for i, d in enumerate(labels)}
    macro = sum(v["f1"] for v in per.values()) / max(1, len(per))
    acc = sum(a == b for a, b in zip(y_true, y_pred, strict=True)) / max(1, len(y_true))
    return {"macro_f1": round(macro, 3), "accuracy": round(acc, 3), "num_examples": len(examples),
            "per_domain": per}


def format_report(name: str, report: dict[str, Any]) -> str:
    lines = [f"{name}: macro-F1 {report['macro_f1']:.3f}  accuracy {report['accuracy']:.3f}  "
             f"(n={report['num_examples']})"]
    for d, v in report["per_domain"].items():
        lines.append(f"  {d:<14} F1 {v['f1']:.3f}  P {v['precision']:.3f}  R {v['recall']:.3f}"
                     f"  n={v['support']}")
    return "\n".join(lines)
