"""The domain classifier's weights folded per word, to score one text in C loops.

A text's score is the sum of the weight rows of its keys
(:mod:`router.features`): every word of the windows as ``("w", word)``, each
head word as ``("h", word)``, each tail word as ``("t", word)``, the adjacent
pairs (when the features have them) and the two shape buckets. Words are
looked up once per window instead of once per key, from rows summed at load:

- a head word: ``w + h``;
- a tail word not in the head: ``w + t``; one also in the head (its ``w`` is
  counted there): ``t``.

So a text costs a set per window, one dict lookup per distinct word (and
pair), through ``map`` over dicts with the unseen row as the default, one
gather and one sum: a third fewer lookups and rows than one per key. The number of keys (for
the l2 norm) comes from the sets' sizes. tests/router/test_classifier.py checks
the scores against the spelled-out keys and the fitted model's.

Example::

    scorer = TextScorer(vocabulary, weights)        # weights [num_keys, num_classes]
    total, num_keys = scorer.summed_rows("Translate to French: good morning")
    # scores = total / sqrt(num_keys) + bias
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from router.features import _WORD_RE, Vocabulary, shape_buckets, windows


class TextScorer:
    """Sums of a text's weight rows, from per-word folded rows."""

    def __init__(self, vocabulary: Vocabulary, weights: np.ndarray) -> None:
        self.config = vocabulary.config
        # NOTE: the vocabulary's own tables: word -> row, pair -> row, shape -> row
        any_, head, tail = vocabulary.word_rows()
        pairs, shapes = vocabulary.pair_rows(), vocabulary.shape_rows()
        num_classes = weights.shape[1]
        zero = np.zeros(num_classes, np.float32)

        def row(table: dict[str, int], word: str) -> np.ndarray:
            got = table.get(word)
            return zero if got is None else weights[got]

        rows: list[np.ndarray] = []

        def add(vector: np.ndarray) -> int:
            rows.append(vector)
            return len(rows) - 1

        words = sorted(set(any_) | set(head) | set(tail))
        self._head = {w: add(row(any_, w) + row(head, w)) for w in words}
        self._tail_only = {w: add(row(any_, w) + row(tail, w)) for w in words}
        self._tail_also = {w: add(row(tail, w)) for w in words if w in tail}
        self._pair = {p: add(weights[r]) for p, r in pairs.items()}
        self._shape = {s: add(weights[r]) for s, r in shapes.items()}
        self.unseen = add(zero)
        self.weights = np.stack(rows).astype(np.float32)  # [num_rows, num_classes]

    def summed_rows(self, text: str) -> tuple[np.ndarray, int]:
        """([num_classes] sum of the weight rows of ``text``'s keys, the number of keys)."""
        c = self.config
        parts = windows(text, c)
        head = _WORD_RE.findall(parts[0])
        in_head = set(head)
        pairs: set[tuple[str, str]] = set()
        if c.word_bigrams:
            pairs.update(zip(head, head[1:], strict=False))
        unseen = self.unseen
        default = repeat(unseen)
        found = [*map(self._head.get, in_head, default)]
        num_keys = 2 * len(in_head)
        if len(parts) > 1:
            tail = _WORD_RE.findall(parts[1])
            in_tail = set(tail)
            if c.word_bigrams:
                pairs.update(zip(tail, tail[1:], strict=False))
            both = in_tail & in_head
            found += map(self._tail_only.get, in_tail - both, default)
            found += map(self._tail_also.get, both, default)
            num_keys += 2 * len(in_tail) - len(both)
        found += map(self._pair.get, pairs, default)
        length, newlines = shape_buckets(text)
        found.append(self._shape.get(("s", length), unseen))
        found.append(self._shape.get(("n", newlines), unseen))
        num_keys += len(pairs) + 2
        rows = np.fromiter(found, np.intp, len(found))
        return self.weights.take(rows, axis=0).sum(axis=0), num_keys
