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
    assert sum(len(w) for w in f.windows(huge)) == 256 + 128


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


def test_memoised_words_give_the_same_features() -> None:
    system = "You are a support agent for ACME. Be polite, cite the manual. " * 20  # > head
    texts = [system + f"Customer {i}: my order {i * 7} never arrived, what now?" for i in range(4)]
    warm = Featurizer(FeatureConfig())
    for _ in range(2):
        for text in texts:
            idx, val = warm.transform(text)
            ref_idx, ref_val = Featurizer(FeatureConfig()).transform(text)  # empty caches
            assert np.array_equal(idx, ref_idx) and np.array_equal(val, ref_val)


def _reference_features(config: FeatureConfig, text: str) -> dict[int, float]:
    """The features spelled out one by one (no vectorising, no caches)."""
    import zlib

    from router.features import _BIGRAM, _CHAR, _HEAD, _P, _SHAPE, _TAIL, _WORD, _WORD_RE, _mix

    def key(x: int, salt: np.uint64) -> int:
        return int(_mix(np.array([x], np.uint64), salt)[0]) & ((1 << config.n_bits) - 1)

    counts: dict[int, int] = {}

    def add(f: int) -> None:
        counts[f] = counts.get(f, 0) + 1

    add(key(min(len(text).bit_length(), 20), _SHAPE))
    add(key(32 + min(text.count("\n", 0, 4096), 20) // 4, _SHAPE))
    for i, part in enumerate(Featurizer(config).windows(text)):
        words = [zlib.crc32(w.encode()) for w in _WORD_RE.findall(part)]
        for w in words:
            add(key(w, _WORD))
            add(key(w, _HEAD if i == 0 else _TAIL))
        if config.word_bigrams:
            for a, b in zip(words, words[1:], strict=False):
                add(key((a * int(_P) + b) % 2**64, _BIGRAM))
        span = part[: config.char_window]
        n = config.char_ngram
        for j in range(len(span) - n + 1 if n else 0):
            h = ord(span[j])
            for c in span[j + 1: j + n]:
                h = (h * int(_P) + ord(c)) % 2**64
            add(key(h, _CHAR))
    norm = sum((1 + np.log(c)) ** 2 for c in counts.values()) ** 0.5
    return {f: float((1 + np.log(c)) / norm) for f, c in counts.items()}


@pytest.mark.parametrize("config", [FeatureConfig(), FeatureConfig(char_ngram=4, head_chars=64),
                                    FeatureConfig(word_bigrams=False, n_bits=12)])
def test_vectorised_features_equal_the_features_spelled_out(config: FeatureConfig) -> None:
    texts = ["", "Translate to French: good morning", "x\n" * 50, "Über straße, naïve café",
             "Summarize: " + "The cat sat on the mat. " * 40 + "What did the cat do?"]
    f = Featurizer(config)
    for text in texts:
        idx, val = f.transform(text)
        ref = _reference_features(config, text)
        assert sorted(ref) == idx.tolist(), text[:40]
        assert np.allclose(val, [ref[i] for i in idx.tolist()], rtol=1e-5), text[:40]
