"""Features, classifier fit/save/load, agreement with the fitted model on held-out prompts,
and the shipped artefact."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from router.classifier import DEFAULT_ARTEFACT, DomainClassifier, TrainConfig, fit_model
from router.dataset import build_default
from router.errors import ClassifierArtefactError
from router.features import FeatureConfig, Vocabulary, feature_keys, windows
from router.scorer import TextScorer

REPO_DATA = Path(__file__).resolve().parents[2] / "data"

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


def test_keys_spelled_out_read_only_the_windows() -> None:
    c = FeatureConfig()
    words = {("w", "hello"), ("w", "world"), ("w", ","), ("h", "hello"), ("h", "world"),
             ("h", ","), ("s", 5), ("n", 0)}
    assert feature_keys("Hello world, hello", c) == words
    pairs = {("b", "hello", "world"), ("b", "world", ","), ("b", ",", "hello")}
    with_pairs = FeatureConfig(word_bigrams=True)
    assert feature_keys("Hello world, hello", with_pairs) == words | pairs
    huge = "word " * 200_000  # a 1 MB prompt reads only the head and tail windows
    assert sum(len(w) for w in windows(huge, c)) == c.head_chars + c.tail_chars == 128 + 64
    assert feature_keys("", c) == {("s", 0), ("n", 0)}


TEXTS = ["", "Translate to French: good morning", "x\n" * 50, "Über straße, naïve café — «ok»",
         "Summarize: " + "The cat sat on the mat. " * 40 + "What did the cat do?",
         "def f(a_b):\n    return a_b  # tail  tail", "日本語のテキストを翻訳してください。"]


@pytest.mark.parametrize("config", [FeatureConfig(), FeatureConfig(head_chars=16, tail_chars=8),
                                    FeatureConfig(word_bigrams=True, min_df=1)])
def test_folded_rows_sum_to_the_rows_of_the_spelled_out_keys(config: FeatureConfig) -> None:
    vocab = Vocabulary.build(TEXTS[1:] * 2, config)  # every key twice: all in the vocabulary
    weights = np.random.default_rng(0).normal(size=(len(vocab.keys), 3)).astype(np.float32)
    scorer = TextScorer(vocab, weights)
    padded = np.concatenate([weights, np.zeros((1, 3), np.float32)])  # the unseen row
    for text in TEXTS + ["an unseen text: zebra quux", "tail words again: cat sat mat cat"]:
        total, num_keys = scorer.summed_rows(text)
        ref_rows, ref_num = vocab.reference_rows(text)
        assert num_keys == ref_num == len(feature_keys(text, config)), text[:40]
        assert np.allclose(total, padded[ref_rows].sum(axis=0), atol=1e-4), text[:40]
    assert vocab.unseen in vocab.reference_rows("an unseen text: zebra quux")[0].tolist()


def test_fit_predicts_training_domains_and_round_trips(tmp_path: Path) -> None:
    texts, labels = zip(*TINY, strict=True)
    clf = DomainClassifier.fit(texts, labels, FeatureConfig(min_df=1), meta={"version": "t"})
    assert [clf.predict(t) for t in texts] == list(labels)
    assert clf.predict("Translate English to German: good night") == "translation"
    path = tmp_path / "clf.npz"
    clf.save(path)
    loaded = DomainClassifier.load(path)
    assert loaded.classes == clf.classes and loaded.meta["version"] == "t"
    for t in texts:
        assert loaded.predict(t) == clf.predict(t)
        assert np.array_equal(loaded.scores(t), clf.scores(t))


def test_fast_scores_agree_with_the_fitted_model_on_held_out_prompts() -> None:
    """The exported weights on the fast path decide as scikit-learn's model does, on every
    held-out prompt of every domain (a model fitted on part of the training side)."""
    split = build_default(REPO_DATA)
    train = split.train[:1500]
    vocab = Vocabulary.build([e.text for e in train], FeatureConfig())
    model = fit_model(vocab.matrix([e.text for e in train]), [e.domain for e in train],
                      TrainConfig(max_iter=100))
    clf = DomainClassifier.from_model(vocab, model)
    test = split.test
    assert {e.domain for e in test} == set(clf.classes)
    texts = [e.text for e in test]
    want = model.predict(vocab.matrix(texts))
    got = [clf.predict(t) for t in texts]
    assert got == list(want)
    decision = model.decision_function(vocab.matrix(texts))
    assert np.allclose([clf.scores(t) for t in texts], decision, atol=1e-4)


def test_shipped_artefact_fast_scores_equal_its_reference_scores() -> None:
    clf = DomainClassifier.load()
    for e in build_default(REPO_DATA).test:
        fast, ref = clf.scores(e.text), clf.reference_scores(e.text)
        assert np.allclose(fast, ref, atol=1e-5), e.text[:60]
        assert int(np.argmax(fast)) == int(np.argmax(ref))


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


def test_windows_read_as_bytes_give_the_regex_words() -> None:
    """read_words (UTF-8 bytes, the regex only over pieces with non-ASCII bytes) gives the
    regex's words for every ASCII character, a sample of every plane's code points and
    random texts, and the scores of the spelled-out keys."""
    from router.features import _WORD_RE
    from router.scorer import read_words, word_key

    def regex_words(text: str) -> set:
        return {word_key(w) for w in _WORD_RE.findall(text)}

    codes = [*range(0x300), *range(0x300, 0x110000, 97), 0x85, 0xA0, 0x2003, 0x2019, 0x201C,
             0x3000, 0xD800, 0xDFFF, 0xFEFF]
    for code in codes:
        ch = chr(code)
        text = f"a{ch}b {ch}{ch} _{ch}9 é{ch}x"
        assert read_words(text) == regex_words(text), hex(code)
    rng = random.Random(1)
    pool = "aZ9_ \t\n.,:;-'\"()[]é日ß\u00a0\u2003\u2019\x1c\x00\x85ǅ½²\U0001F600"
    for _ in range(3000):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(60))).lower()
        assert read_words(text) == regex_words(text), repr(text)
        ascii_text = "".join(chr(rng.randrange(128)) for _ in range(rng.randrange(60)))
        assert read_words(ascii_text) == regex_words(ascii_text), repr(ascii_text)
    clf = DomainClassifier.load()
    for text in TEXTS + [t + "é" for t in TEXTS] + ["x" * 130 + " tail: what? é", "é" + "y " * 99]:
        sums, num_keys = clf.scorer.class_sums(text)
        ref_rows, ref_num = clf.vocabulary.reference_rows(text)
        assert num_keys == ref_num, text[:40]
        assert np.allclose(sums, clf.weights[ref_rows].astype(np.float64).sum(axis=0),
                           atol=1e-5), text[:40]
