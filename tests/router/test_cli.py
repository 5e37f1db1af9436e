"""`polyinfer train-classifier` on small labelled JSONL and trace files."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.cli import main
from router.classifier import DomainClassifier

ROWS = [
    {"text": "Translate German to English: Guten Morgen", "domain": "translation"},
    {"prompt": "Translate to French: I like bread", "domain": "translation"},
    {"messages": [{"role": "user", "content": "Translate to Spanish: where is the station?"}],
     "domain": "translation"},
    {"text": "Write a Python function that sorts a list", "domain": "code"},
    {"prompt_text": "Implement binary search in C", "domain": "code"},
    {"text": "def f(x):\n    return x * 2\n# add type hints", "domain": "code"},
] * 4


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_train_from_jsonl_and_traces(tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "l.jsonl", [{**r, "group": str(i)} for i, r in enumerate(ROWS)])
    traces = write_jsonl(tmp_path / "t.jsonl", [
        {"request_id": "a", "domain": "code", "prompt_tokens": 10},  # no text: skipped
        {"request_id": "b", "domain": "code", "prompt_text": "Write a Rust struct for a queue"},
    ])
    out = tmp_path / "clf.npz"
    rc = main(["train-classifier", "--no-default-corpus", "--jsonl", str(data), "--traces", str(traces),
               "--held-out", "0.25", "--out", str(out), "--report", str(tmp_path / "r.json")])
    assert rc == 0
    clf = DomainClassifier.load(out)
    assert clf.predict("Translate German to English: Danke") == "translation"
    assert clf.meta["num_train"] + clf.meta["num_held_out"] == len(ROWS) + 1
    assert "macro-F1" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert "held-out (all sources)" in report


def test_bad_input_exits_2_and_names_the_line(tmp_path: Path, caplog) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi", "domain": "code"}\n{"text": "x", "domain": "poetry"}\n')
    out = str(tmp_path / "o.npz")
    assert main(["train-classifier", "--no-default-corpus", "--jsonl", str(bad), "--out", out]) == 2
    assert "bad.jsonl:2" in caplog.text
    assert main(["train-classifier", "--no-default-corpus", "--out", out]) == 2
    assert main(["train-classifier", "--data", str(tmp_path / "nowhere"), "--out", out]) == 2
    assert "no prompts/ folder in" in caplog.text


def test_the_default_corpus_comes_from_the_repository_data() -> None:
    from router.cli import DEFAULT_DATA
    from router.dataset import build_default

    split = build_default(DEFAULT_DATA)
    sources = {e.source for e in split.train + split.test}
    assert DEFAULT_DATA == Path(__file__).resolve().parents[2] / "data"
    assert {"spec_bench", "gsm8k"} <= sources
    assert sum(e.source == "gsm8k" for e in split.train + split.test) == 2500
