"""Featurizer, classifier fit/save/load, and the shipped artefact on held-out-style prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from router.classifier import DEFAULT_ARTEFACT, DomainClassifier
from router.errors import ClassifierArtefactError
from router.features import FeatureConfig, Featurizer

TINY = [
    ("Translate German to English: Guten Morgen, wie geht es dir?", "translation"),
    ("Translate to French: the cat sleeps on the sofa", "translation"),
    ("Übersetze ins Englische: Der Hund läuft schnell", "translation"),
    ("def add(a, b):\n    return a + b\n# write tests for this function", "code"),
    ("Write a Python function that reverses a linked list", "code"),
    ("Implement quicksort in Rust with a generic comparator", "code"),
    ("Tom has 3 apples and buys 5 more. How many apples does he have?", "math"),
    ("A train travels 60 miles per hour for 3 hours. How far does it go?", "math"),
    ("Sara earns $12 an hour and works 7 hours. How much does she earn?", "math"),
]


def test_featurizer_is_deterministic_bounded_and_normalised() -> None:
    f = Featurizer(FeatureConfig(n_bits=12))
    idx, val = f.transform("Hello world, hello")
    idx2, val2 = f.transform("Hello world, hello")
    assert np.array_equal(idx, idx2) and np.array_equal(val, val2)
    assert idx.min() >= 0 and idx.max() < 4096
    assert np.all(np.diff(idx) > 0)  # sorted, unique
    assert float(np.dot(val, val)) == pytest.approx(1.0, rel=1e-5)
    # a 1 MB prompt reads only the capped head and tail windows
    huge = "word " * 200_000
    assert sum(len(w) for w in f.windows(huge)) == 640 + 256


def test_featurizer_empty_text() -> None:
    idx, val = Featurizer(FeatureConfig()).transform("")
    assert len(idx) == len(val) > 0  # the length/newline shape features are always there


def test_fit_predicts_training_domains_and_round_trips(tmp_path: Path) -> None:
    texts, labels = zip(*TINY, strict=True)
    clf = DomainClassifier.fit(texts, labels, FeatureConfig(n_bits=14), meta={"version": "t"})
    assert [clf.predict(t) for t in texts] == list(labels)
    assert clf.predict("Translate English to German: good night") == "translation"
    path = tmp_path / "clf.npz"
    clf.save(path)
    loaded = DomainClassifier.load(path)
    assert loaded.classes == clf.classes and loaded.meta["version"] == "t"
    for t in texts:  # float16 storage: same decisions, scores within rounding
        assert loaded.predict(t) == clf.predict(t)
        assert np.allclose(loaded.scores(t), clf.scores(t), atol=1e-2)


def test_fit_rejects_unknown_labels() -> None:
    with pytest.raises(ValueError, match="outside DOMAINS"):
        DomainClassifier.fit(["a", "b"], ["code", "poetry"])


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    with pytest.raises(ClassifierArtefactError, match="bad.npz"):
        DomainClassifier.load(bad)
    with pytest.raises(ClassifierArtefactError, match="missing.npz"):
        DomainClassifier.load(tmp_path / "missing.npz")


def test_shipped_artefact_loads_and_classifies_obvious_prompts() -> None:
    assert DEFAULT_ARTEFACT.is_file()
    clf = DomainClassifier.load()
    assert set(clf.classes) == {"code", "math", "chat", "qa", "summarization", "translation",
                                "rag", "extraction"}
    # prompts written for this test (not in any training source)
    cases = {
        "Translate German to English: Die Katze schläft auf dem warmen Dach .": "translation",
        "Summarize: The city council met on Monday to discuss the new budget. " * 20: "summarization",
        "Write a Go function that parses an ISO-8601 date and returns a time.Time.": "code",
        "Maria buys 4 boxes of pencils with 12 pencils each and gives away 9. "
        "How many pencils does she have left?": "math",
        "Who wrote the novel war and peace?": "qa",
    }
    for text, domain in cases.items():
        assert clf.predict(text) == domain, text[:60]


def test_memoised_windows_give_the_same_features() -> None:
    system = "You are a support agent for ACME. Be polite, cite the manual. " * 20  # > head
    texts = [system + f"Customer {i}: my order {i * 7} never arrived, what now?" for i in range(4)]
    warm = Featurizer(FeatureConfig())
    for _ in range(2):
        for text in texts:
            idx, val = warm.transform(text)
            ref_idx, ref_val = Featurizer(FeatureConfig()).transform(text)  # empty caches
            assert np.array_equal(idx, ref_idx) and np.array_equal(val, ref_val)
    info = warm._window_hashes.cache_info()
    assert info.misses == 1 + len(texts)  # one shared head window, one tail per text
    assert info.hits == 2 * len(texts) * 2 - info.misses
