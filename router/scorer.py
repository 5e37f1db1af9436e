"""The domain classifier's weights folded per word, to score one text in C loops.

A text's score is the sum of the weight rows of its keys
(:mod:`router.features`): every word of the windows as ``("w", word)``, each
head word as ``("h", word)``, each tail word as ``("t", word)``, the adjacent
pairs (when the features have them) and the two shape buckets. Words are
looked up once per window instead of once per key, from rows summed at load:

- a head word: ``w + h``;
- a tail word not in the head: ``w + t``; one also in the head (its ``w`` is
  counted there): ``t``.

Each folded row is held as one Python int: its class values in fixed point,
one 64-bit lane a class (``LANE_BITS``), signed. Adding such ints adds every
lane at once and exactly (integer addition is linear; a lane's negative value
borrows from the next one and is given back when the sum is unpacked), so a
text costs one set per window, one ``map`` of dict lookups per window with
``sum`` over it (C loops, no per-word Python), and one unpack of the total: no
numpy call, whose fixed cost was more than the lookups' at ~40 words. The
fraction bits are chosen at load so that no sum can overflow a lane; the
rounding is 2**-41 a row at most (float32 sums, as before, round ~1e-7 a row).
The number of keys (for the l2 norm) comes from the sets' sizes.

An ASCII window (most prompts' heads and tails) is read as bytes: one
``bytes.translate`` to spaces and a ``split`` give its runs of word
characters, a second ``translate`` that deletes word characters and spaces
gives its punctuation (each one word of the regex, as an int), and the rows are
looked up in tables keyed the same way: the same words, sets and sums as the
regex, at about half the cost of the str path (bench/classify.py).
tests/router/test_classifier.py checks the scores against the spelled-out
keys and the fitted model's.

Example::

    scorer = TextScorer(vocabulary, weights)        # weights [num_keys, num_classes]
    total, num_keys = scorer.class_sums("Translate to French: good morning")
    # scores = total / sqrt(num_keys) + bias
"""

from __future__ import annotations

import math
import re
import struct
from itertools import repeat
from typing import Any

import numpy as np

from router.features import _WORD_RE, Vocabulary, shape_buckets, windows

LANE_BITS = 64  # one class value per lane of a packed row
MAX_FRACTION_BITS = 40
# NOTE: the regex's own classes over ASCII (``\w`` word characters, ``\s`` spaces, which
# for str patterns include \x1c-\x1f), so the bytes path splits exactly as the regex does
_IS_WORD, _IS_SPACE = re.compile(r"\w").fullmatch, re.compile(r"\s").fullmatch
# every byte but a word character -> a space: ``split`` then gives the runs of word characters
_TO_SPACES = bytes(c if _IS_WORD(chr(c)) else 0x20 for c in range(256))
# deleted to leave the punctuation (``[^\w\s]``: each such character is one word)
_WORD_OR_SPACE = bytes(c for c in range(128) if _IS_WORD(chr(c)) or _IS_SPACE(chr(c)))


def word_set(window: str) -> set[str]:
    """The distinct words of ``window``, as ``set(_WORD_RE.findall(window))``.

    NOTE: a whitespace-separated piece that is all alphanumerics is one word of the regex
    (its ``\\w`` is ``str.isalnum`` or ``_``, its ``\\s`` is what ``str.split`` splits on),
    so only the other pieces go through the regex: one C split and one findall over the
    few pieces with punctuation, about half the cost of the regex over the window.
    """
    words = set(window.split())
    odd = [w for w in words if not w.isalnum()]
    if odd:
        words.difference_update(odd)
        words.update(_WORD_RE.findall(" ".join(odd)))
    return words


def ascii_word_set(window: bytes) -> set[bytes | int]:
    """The distinct words of an ASCII ``window``: runs of word characters as bytes, each
    punctuation character as its code (``ascii_key`` of ``word_set``'s words)."""
    words: set[bytes | int] = set(window.translate(_TO_SPACES).split())
    words.update(window.translate(None, _WORD_OR_SPACE))
    return words


def ascii_key(word: str) -> bytes | int:
    """An ASCII regex word as ``ascii_word_set`` gives it."""
    return ord(word) if len(word) == 1 and not _IS_WORD(word) else word.encode()


class TextScorer:
    """Sums of a text's weight rows, from per-word folded rows packed into ints."""

    def __init__(self, vocabulary: Vocabulary, weights: np.ndarray) -> None:
        self.config = vocabulary.config
        # NOTE: the vocabulary's own tables: word -> row, pair -> row, shape -> row
        any_, head, tail = vocabulary.word_rows()
        pairs, shapes = vocabulary.pair_rows(), vocabulary.shape_rows()
        self.num_classes = num_classes = weights.shape[1]
        w64 = weights.astype(np.float64)
        zero = np.zeros(num_classes)

        def row(table: dict[str, int], word: str) -> np.ndarray:
            got = table.get(word)
            return zero if got is None else w64[got]

        words = sorted(set(any_) | set(head) | set(tail))
        folded: dict[str, dict[Any, np.ndarray]] = {
            "head": {w: row(any_, w) + row(head, w) for w in words},
            "tail_only": {w: row(any_, w) + row(tail, w) for w in words},
            "tail_also": {w: row(tail, w) for w in words if w in tail},
            "pair": {p: w64[r] for p, r in pairs.items()},
            "shape": {s: w64[r] for s, r in shapes.items()},
        }
        # NOTE: a text adds each folded row at most once, so no sum exceeds the sum of
        # every row's largest |value|: the fraction bits leave that much room in a lane.
        bound = sum(float(np.abs(v).max(initial=0.0)) for t in folded.values()
                    for v in t.values()) + 1.0
        self.fraction_bits = min(MAX_FRACTION_BITS, LANE_BITS - 2 - math.ceil(math.log2(bound)))
        if self.fraction_bits < 16:
            raise ValueError(f"weights too large to pack: sum of |rows| {bound:.3g}")
        scale = float(1 << self.fraction_bits)

        def pack(vector: np.ndarray) -> int:
            lanes = np.rint(vector * scale).astype(np.int64).tolist()
            return sum(v << (LANE_BITS * i) for i, v in enumerate(lanes))

        def packed(table: dict[Any, np.ndarray]) -> dict[Any, int]:
            return {k: pack(v) for k, v in table.items() if v.any()}  # zero rows: absent

        self._head: dict[str, int] = packed(folded["head"])
        self._tail_only: dict[str, int] = packed(folded["tail_only"])
        self._tail_also: dict[str, int] = packed(folded["tail_also"])
        self._pair: dict[tuple[str, str], int] = packed(folded["pair"])
        self._shape: dict[tuple[str, int], int] = packed(folded["shape"])

        def ascii_table(table: dict[str, int]) -> dict[bytes | int, int]:
            return {ascii_key(w): v for w, v in table.items() if w.isascii()}

        self._head_a = ascii_table(self._head)
        self._tail_only_a = ascii_table(self._tail_only)
        self._tail_also_a = ascii_table(self._tail_also)
        half = 1 << (LANE_BITS - 1)
        # adding ``half`` to every lane makes each lane of a sum non-negative: plain digits
        self._lane_offset = sum(half << (LANE_BITS * i) for i in range(num_classes))
        self._half = half
        self._unpack = struct.Struct(f"<{num_classes}Q").unpack
        self._num_bytes = num_classes * LANE_BITS // 8
        self._unit = 1.0 / scale

    def class_sums(self, text: str) -> tuple[list[float], int]:
        """(the per-class sums of the weight rows of ``text``'s keys, the number of keys)."""
        total, num_keys = self._packed_sum(text)
        lanes = self._unpack((total + self._lane_offset).to_bytes(self._num_bytes, "little"))
        half, unit = self._half, self._unit
        return [(v - half) * unit for v in lanes], num_keys

    def best(self, text: str, bias: list[float]) -> int:
        """The index of the largest ``sum / sqrt(num_keys) + bias``: ``class_sums`` and the
        classifier's scores in one pass, on Python floats, in the same order of operations."""
        total, num_keys = self._packed_sum(text)
        lanes = self._unpack((total + self._lane_offset).to_bytes(self._num_bytes, "little"))
        half, unit, scale = self._half, self._unit, 1.0 / math.sqrt(num_keys)
        scores = [(v - half) * unit * scale + b for v, b in zip(lanes, bias, strict=True)]
        return scores.index(max(scores))

    def summed_rows(self, text: str) -> tuple[np.ndarray, int]:
        """``class_sums`` as a [num_classes] array."""
        sums, num_keys = self.class_sums(text)
        return np.array(sums), num_keys

    def _packed_sum(self, text: str) -> tuple[int, int]:
        c = self.config
        if c.word_bigrams:
            return self._packed_sum_with_pairs(text)
        head_chars, tail_chars = c.head_chars, c.tail_chars
        zeros = repeat(0)
        whole = len(text) <= head_chars + tail_chars
        head = text.lower() if whole else text[:head_chars].lower()
        tail = "" if whole or not tail_chars else text[-tail_chars:].lower()
        # NOTE: isascii is O(1) (a str's kind); a window that is ASCII takes the bytes path
        if head.isascii() and tail.isascii():
            in_head: set[Any] = ascii_word_set(head.encode())
            in_tail: set[Any] = ascii_word_set(tail.encode()) if tail else set()
            head_rows, tail_only, tail_also = self._head_a, self._tail_only_a, self._tail_also_a
        else:
            in_head = word_set(head)
            in_tail = word_set(tail) if tail else set()
            head_rows, tail_only, tail_also = self._head, self._tail_only, self._tail_also
        total = sum(map(head_rows.get, in_head, zeros))
        num_keys = 2 * len(in_head) + 2
        if in_tail:
            both = in_tail & in_head
            total += sum(map(tail_only.get, in_tail - both, zeros))
            total += sum(map(tail_also.get, both, zeros))
            num_keys += 2 * len(in_tail) - len(both)
        length, newlines = shape_buckets(text)
        shape = self._shape.get
        return total + shape(("s", length), 0) + shape(("n", newlines), 0), num_keys

    def _packed_sum_with_pairs(self, text: str) -> tuple[int, int]:
        """The same with adjacent-pair keys (ordered words: the regex over each window)."""
        parts = windows(text, self.config)
        zeros = repeat(0)
        head = _WORD_RE.findall(parts[0])
        in_head = set(head)
        pairs = set(zip(head, head[1:], strict=False))
        total = sum(map(self._head.get, in_head, zeros))
        num_keys = 2 * len(in_head)
        if len(parts) > 1:
            tail = _WORD_RE.findall(parts[1])
            in_tail = set(tail)
            pairs.update(zip(tail, tail[1:], strict=False))
            both = in_tail & in_head
            total += sum(map(self._tail_only.get, in_tail - both, zeros))
            total += sum(map(self._tail_also.get, both, zeros))
            num_keys += 2 * len(in_tail) - len(both)
        total += sum(map(self._pair.get, pairs, zeros))
        length, newlines = shape_buckets(text)
        total += self._shape.get(("s", length), 0) + self._shape.get(("n", newlines), 0)
        return total, num_keys + len(pairs) + 2
