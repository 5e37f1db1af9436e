"""Word n-gram features of a bounded sample of the text, for the domain classifier.

A text's features are the set of keys (binary presence, l2-normalised over
all of the text's keys) read from two windows: the head, where instructions
like "Summarize:" or a system prompt live, and the tail, where a RAG question
or the last chat turn lives. That bounds the cost however long the prompt is;
reading the whole text instead is no better on held-out prompts
(bench/classify.py --train-full). The keys:

- ``("w", word)``: a word anywhere in the windows; ``("h", word)`` /
  ``("t", word)``: in the head / the tail window (a text short enough to be
  read whole is one head window);
- ``("b", word, next_word)``: adjacent words of one window (``word_bigrams``;
  off in the shipped model: no better on the validation split);
- ``("s", length bucket)``, ``("n", newline bucket)``: the text's shape.

:meth:`Vocabulary.build` keeps the keys seen in at least ``min_df`` training
texts, so the model has one weight row per kept key and an unseen key weighs
nothing (it still counts in the norm). :func:`feature_keys` is the definition
training uses; :class:`router.scorer.TextScorer` computes the same sums for one
text with C loops only (sets, ``zip``, ``map`` over dicts): no hashing of
n-grams in Python. It replaced hashed log-count features evaluated with ~40
numpy calls, which cost more a text and scored lower on held-out prompts
(bench/RESULTS.md).

Example::

    vocab = Vocabulary.build(texts, FeatureConfig())
    rows, num_keys = vocab.reference_rows("Translate German to English: Guten Morgen")
    # rows: the weight row of each key (keys outside the vocabulary: vocab.unseen)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

_WORD_RE = re.compile(r"\w+|[^\w\s]")
Key = tuple[str, ...] | tuple[str, int]


@dataclass(frozen=True)
class FeatureConfig:
    # NOTE: chosen on a validation split of the training side (30% of its groups): 128 + 64
    # characters scored as well as 256 + 128 (bench/RESULTS.md) with half the keys.
    head_chars: int = 128  # characters read from the start of the text
    tail_chars: int = 64  # characters read from the end (RAG question, last turn)
    # NOTE: adjacent-pair keys scored no better on the validation split (0.803 against 0.804
    # macro-F1 at 128 + 64) and were ~40% of the keys to look up: off by default.
    word_bigrams: bool = False
    min_df: int = 2  # a key is in the vocabulary if at least this many training texts have it

    def __post_init__(self) -> None:
        if self.head_chars <= 0 or self.tail_chars < 0:
            raise ValueError("head_chars must be > 0 and tail_chars >= 0")
        if self.min_df < 1:
            raise ValueError(f"min_df: expected >= 1, got {self.min_df!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def windows(text: str, config: FeatureConfig) -> list[str]:
    """The parts of ``text`` that are read: head and (if long) tail, lowercased."""
    if len(text) <= config.head_chars + config.tail_chars:
        return [text.lower()]
    parts = [text[: config.head_chars].lower()]
    if config.tail_chars:
        parts.append(text[-config.tail_chars:].lower())
    return parts


def shape_buckets(text: str) -> tuple[int, int]:
    """(length bucket, newline bucket) of the whole text: the newlines of its first 4096
    characters, counted to 20."""
    # NOTE: the bucket is full at 20 newlines: most texts that have them do in 1,024 chars
    newlines = text.count("\n", 0, 1024)
    if newlines < 20:
        newlines += text.count("\n", 1024, 4096)
    return min(len(text).bit_length(), 20), min(newlines, 20) // 4


def feature_keys(text: str, config: FeatureConfig) -> set[Key]:
    """The text's keys, spelled out (what training reads)."""
    keys: set[Key] = set()
    for i, window in enumerate(windows(text, config)):
        words = _WORD_RE.findall(window)
        tag = "h" if i == 0 else "t"
        for j, word in enumerate(words):
            keys.add(("w", word))
            keys.add((tag, word))
            if config.word_bigrams and j > 0:
                keys.add(("b", words[j - 1], word))
    length, newlines = shape_buckets(text)
    keys.add(("s", length))
    keys.add(("n", newlines))
    return keys


class Vocabulary:
    """Key -> weight row; the last row (``num_rows - 1``) is every unseen key's."""

    def __init__(self, config: FeatureConfig, keys: Sequence[Key]) -> None:
        self.config = config
        self.keys = list(keys)
        self.unseen = len(self.keys)
        self._any: dict[str, int] = {}
        self._head: dict[str, int] = {}
        self._tail: dict[str, int] = {}
        self._pair: dict[tuple[str, str], int] = {}
        self._shape: dict[tuple[str, int], int] = {}
        self._index: dict[Key, int] | None = None  # key -> row, built for training only
        by_tag = {"w": self._any, "h": self._head, "t": self._tail}
        for row, key in enumerate(self.keys):
            if key[0] in by_tag:
                by_tag[key[0]][str(key[1])] = row
            elif key[0] == "b" and len(key) == 3:
                self._pair[(str(key[1]), str(key[2]))] = row
            else:
                self._shape[(str(key[0]), int(key[1]))] = row

    @property
    def num_rows(self) -> int:
        return len(self.keys) + 1

    @classmethod
    def build(cls, texts: Iterable[str], config: FeatureConfig) -> Vocabulary:
        df = Counter(k for text in texts for k in feature_keys(text, config))
        return cls(config, sorted((k for k, n in df.items() if n >= config.min_df), key=repr))

    def word_rows(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Rows of the ``"w"``, ``"h"`` and ``"t"`` keys, by word."""
        return self._any, self._head, self._tail

    def pair_rows(self) -> dict[tuple[str, str], int]:
        return self._pair

    def shape_rows(self) -> dict[tuple[str, int], int]:
        return self._shape

    def reference_rows(self, text: str) -> tuple[np.ndarray, int]:
        """The rows of :func:`feature_keys` (sorted; unseen keys: ``unseen``) and their
        number."""
        if self._index is None:
            self._index = {k: row for row, k in enumerate(self.keys)}
        keys = feature_keys(text, self.config)
        rows = sorted(self._index.get(k, self.unseen) for k in keys)
        return np.array(rows, np.intp), len(keys)

    def matrix(self, texts: Sequence[str]):  # -> scipy.sparse.csr_matrix [texts, keys]
        """Training rows from the spelled-out keys: 1 / sqrt(num_keys) at each kept key."""
        from scipy.sparse import csr_matrix

        indptr, indices, values = [0], [], []
        for text in texts:
            rows, num_keys = self.reference_rows(text)
            rows = rows[rows != self.unseen]
            indices.append(rows)
            values.append(np.full(len(rows), 1.0 / np.sqrt(num_keys)))
            indptr.append(indptr[-1] + len(rows))
        return csr_matrix((np.concatenate(values), np.concatenate(indices), np.array(indptr)),
                          shape=(len(texts), len(self.keys)))

    def to_json(self) -> list[list[Any]]:
        return [list(k) for k in self.keys]

    @classmethod
    def from_json(cls, config: FeatureConfig, keys: Sequence[Sequence[Any]]) -> Vocabulary:
        return cls(config, [tuple(k) for k in keys])  # type: ignore[misc]
