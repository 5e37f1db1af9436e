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

A window is read as its UTF-8 bytes: one ``bytes.translate`` that turns
every ASCII byte but a word character into a space and a ``split`` give its
pieces; a second ``translate`` that deletes ASCII word characters, spaces and
every non-ASCII byte leaves its ASCII punctuation (each one word of the regex,
kept as its code). A piece that is ASCII is one run of word characters (kept
as bytes); only a piece with non-ASCII bytes (a word with an umlaut, a curly
quote) is decoded and split by the regex, its ASCII words re-keyed the same
way. The tables are keyed the same way (bytes, int, and str for non-ASCII
words): the same words, sets and sums as the regex (``read_words``). An ASCII
window costs about half of the earlier str split (``str.split`` and the regex
over the pieces with punctuation); one with non-ASCII characters about the same.
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
from itertools import filterfalse, repeat
from operator import add, mul, sub
from typing import Any

import numpy as np

from router.features import _WORD_RE, Vocabulary, shape_buckets, windows

LANE_BITS = 64  # one class value per lane of a packed row
MAX_FRACTION_BITS = 40
# NOTE: the regex's own classes over ASCII (``\w`` word characters, ``\s`` spaces, which
# for str patterns include \x1c-\x1f), so the bytes path splits exactly as the regex does
_IS_WORD, _IS_SPACE = re.compile(r"\w").fullmatch, re.compile(r"\s").fullmatch
# every ASCII byte but a word character -> a space (non-ASCII bytes kept: ``split`` then
# cuts at ASCII spaces and punctuation only)
_TO_SPACES = bytes(c if c >= 0x80 or _IS_WORD(chr(c)) else 0x20 for c in range(256))
# deleted to leave the ASCII punctuation (``[^\w\s]``: each such character is one word)
_NOT_PUNCTUATION = bytes(c for c in range(256)
                         if c >= 0x80 or _IS_WORD(chr(c)) or _IS_SPACE(chr(c)))


def word_key(word: str) -> bytes | int | str:
    """How ``read_words`` keys a regex word: an ASCII run of word characters as its bytes,
    an ASCII punctuation character as its code, a word with non-ASCII characters as is."""
    if not word.isascii():
        return word
    return ord(word) if len(word) == 1 and not _IS_WORD(word) else word.encode()


def read_words(window: str) -> set[bytes | int | str]:
    """``{word_key(w) for w in _WORD_RE.findall(window)}``, from C loops over the bytes.

    NOTE: the pieces between ASCII non-word bytes cannot hold a word's edge but at their
    ends (an ASCII space or punctuation character is never inside a ``\\w`` run), so the
    regex over each piece with non-ASCII bytes (valid UTF-8: it is cut at ASCII bytes) gives
    the rest of the window's words.
    """
    data = window.encode("utf-8", "surrogatepass")
    words: set[Any] = set(data.translate(_TO_SPACES).split())
    if not window.isascii():  # NOTE: O(1): the str's kind
        odd = list(filterfalse(bytes.isascii, words))
        words.difference_update(odd)
        # NOTE: an odd piece's ASCII words are runs of word characters (its ASCII
        # punctuation became spaces): bytes keys; the rest are keyed as str
        words.update([w.encode() if w.isascii() else w for w in _WORD_RE.findall(
            b" ".join(odd).decode("utf-8", "surrogatepass"))])
    words.update(data.translate(None, _NOT_PUNCTUATION))
    return words


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

        # NOTE: the word tables as read_words keys them (the str ones serve the pair keys)
        self._head_k = {word_key(w): v for w, v in self._head.items()}
        self._tail_only_k = {word_key(w): v for w, v in self._tail_only.items()}
        self._tail_also_k = {word_key(w): v for w, v in self._tail_also.items()}
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
        # NOTE: ``(v - half) * unit * scale + b`` per class, as operator maps (C loops, the
        # same operations in the same order as a comprehension, ~8x fewer bytecodes)
        scale = 1.0 / math.sqrt(num_keys)
        scores = list(map(add, map(mul, map(mul, map(sub, lanes, repeat(self._half)),
                                            repeat(self._unit)), repeat(scale)), bias))
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
        if len(text) <= head_chars + tail_chars:
            in_head = read_words(text.lower())
            in_tail: set[Any] = set()
        else:
            in_head = read_words(text[:head_chars].lower())
            in_tail = read_words(text[-tail_chars:].lower()) if tail_chars else set()
        total = sum(map(self._head_k.get, in_head, zeros))
        num_keys = 2 * len(in_head) + 2
        if in_tail:
            both = in_tail & in_head
            total += sum(map(self._tail_only_k.get, in_tail - both, zeros))
            total += sum(map(self._tail_also_k.get, both, zeros))
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
