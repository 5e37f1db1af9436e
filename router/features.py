"""Hashed word and character n-gram features for the domain classifier.

The featurizer is pure Python with a fixed, process-independent hash
(``zlib.crc32``), so training (``router.classifier.fit``) and serving compute
identical features and the shipped artefact is just weights plus these
parameters. It looks at a capped window of the text (the head, where
instructions like "Summarize:" or a system prompt live, and the tail, where a
RAG question or the last chat turn lives), which bounds its cost no matter how
long the prompt is.

Example::

    f = Featurizer(FeatureConfig())
    idx, val = f.transform("Translate German to English: Guten Morgen")
    # idx: sorted unique feature ids in [0, 2**n_bits); val: l2-normalised weights
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

_WORD_RE = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")


@dataclass(frozen=True)
class FeatureConfig:
    n_bits: int = 18  # feature space is 2**n_bits hashed buckets
    head_chars: int = 640  # characters read from the start of the text
    tail_chars: int = 256  # characters read from the end (RAG question, last turn)
    char_ngram: int = 4  # character n-gram length (0 disables)
    char_window: int = 384  # characters of each window that feed char n-grams
    word_bigrams: bool = True

    def __post_init__(self) -> None:
        if not 10 <= self.n_bits <= 24:
            raise ValueError(f"n_bits: expected 10..24, got {self.n_bits!r}")
        if self.head_chars <= 0 or self.tail_chars < 0:
            raise ValueError("head_chars must be > 0 and tail_chars >= 0")
        if self.char_ngram < 0 or self.char_window < 0:
            raise ValueError("char_ngram and char_window must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _hash(key: str, mask: int) -> int:
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) & mask


class Featurizer:
    """Turns a text into a sparse, l2-normalised hashed feature vector."""

    def __init__(self, config: FeatureConfig) -> None:
        self.config = config
        self._mask = (1 << config.n_bits) - 1

    @property
    def num_features(self) -> int:
        return 1 << self.config.n_bits

    def windows(self, text: str) -> list[str]:
        """The parts of ``text`` that are read: head and (if long) tail, lowercased."""
        c = self.config
        if len(text) <= c.head_chars + c.tail_chars:
            return [text.lower()]
        parts = [text[: c.head_chars].lower()]
        if c.tail_chars:
            parts.append(text[-c.tail_chars:].lower())
        return parts

    def counts(self, text: str) -> Counter[int]:
        c = self.config
        mask = self._mask
        feats: Counter[int] = Counter()
        for i, part in enumerate(self.windows(text)):
            tag = "h" if i == 0 else "t"
            words = _WORD_RE.findall(part)
            for w in words:
                feats[_hash("w" + w, mask)] += 1
                feats[_hash(tag + w, mask)] += 1
            if c.word_bigrams:
                for a, b in zip(words, words[1:], strict=False):
                    feats[_hash(f"b{a} {b}", mask)] += 1
            if c.char_ngram:
                span = part[: c.char_window]
                n = c.char_ngram
                for j in range(len(span) - n + 1):
                    feats[_hash("c" + span[j: j + n], mask)] += 1
        feats[_hash(f"len{_length_bucket(len(text))}", mask)] += 1
        feats[_hash(f"nl{min(text.count(chr(10)), 20) // 4}", mask)] += 1
        return feats

    def transform(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Feature ids (int64, sorted) and values (float32, unit l2 norm)."""
        feats = self.counts(text)
        if not feats:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        idx = np.fromiter(feats.keys(), np.int64, len(feats))
        val = np.fromiter((1.0 + math.log(v) for v in feats.values()), np.float32, len(feats))
        val /= float(np.sqrt(np.dot(val, val)))
        order = np.argsort(idx)
        return idx[order], val[order]


def _length_bucket(num_chars: int) -> int:
    return min(int(math.log2(num_chars + 1)), 16)
