"""Hashed word and character n-gram features for the domain classifier.

The featurizer is deterministic across processes (no salted ``hash()``), so
training (``router.classifier.fit``) and serving compute identical features
and the shipped artefact is just weights plus these parameters. It looks at a
bounded sample of the text — a head window, where instructions like
"Summarize:" or a system prompt live, and a tail window, where a RAG question
or the last chat turn lives — which bounds its cost however long the prompt is.
Reading the whole text instead is no better on held-out prompts (worse on
Spec-Bench: bench/classify.py --train-full).

NOTE: speed. Hashing every n-gram string in Python costs ~0.3 us each and a
prompt has ~1,500 of them. Instead character 4-grams are hashed as a
polynomial over code points, vectorised in numpy; word hashes come from a
bounded per-instance cache (crc32 of the word, computed once per distinct
word); bigrams combine two word hashes arithmetically. All hashes go through
one 64-bit mixer with a per-kind salt, in one vectorised pass over both
windows, and are masked to ``n_bits``.

Example::

    f = Featurizer(FeatureConfig())
    idx, val = f.transform("Translate German to English: Guten Morgen")
    # idx: sorted unique feature ids in [0, 2**n_bits); val: l2-normalised weights
"""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

_WORD_RE = re.compile(r"\w+|[^\w\s]")
_U64 = np.uint64
# salts per feature kind (arbitrary odd 64-bit constants)
_WORD, _HEAD, _TAIL, _BIGRAM, _CHAR, _SHAPE = (
    _U64(0x9E3779B97F4A7C15), _U64(0xC2B2AE3D27D4EB4F), _U64(0x165667B19E3779F9),
    _U64(0xD6E8FEB86659FD93), _U64(0xFF51AFD7ED558CCD), _U64(0xC4CEB9FE1A85EC53))
_P = _U64(0x100000001B3)  # FNV prime: polynomial base for character n-grams
_M1, _M2 = _U64(0xFF51AFD7ED558CCD), _U64(0xC4CEB9FE1A85EC53)
_WORD_CACHE_SIZE = 200_000


@dataclass(frozen=True)
class FeatureConfig:
    n_bits: int = 18  # feature space is 2**n_bits hashed buckets
    # NOTE: 256 + 128 characters read as well as 640 + 256 with char 4-grams (validation
    # split of the training side, bench/classify.py --quality on the held-out one) at a
    # fifth of the features (~200 a text, each a random read of the weights).
    head_chars: int = 256  # characters read from the start of the text
    tail_chars: int = 128  # characters read from the end (RAG question, last turn)
    char_ngram: int = 0  # character n-gram length (0 disables)
    char_window: int = 384  # characters of each window that feed char n-grams
    word_bigrams: bool = True
    hash_version: int = 2  # 2 = vectorised hashing (this module)

    def __post_init__(self) -> None:
        if not 10 <= self.n_bits <= 24:
            raise ValueError(f"n_bits: expected 10..24, got {self.n_bits!r}")
        if self.head_chars <= 0 or self.tail_chars < 0:
            raise ValueError("head_chars must be > 0 and tail_chars >= 0")
        if not 0 <= self.char_ngram <= 8 or self.char_window < 0:
            raise ValueError("char_ngram must be 0..8 and char_window >= 0")
        if self.hash_version != 2:
            raise ValueError(f"hash_version: this code computes version 2, got {self.hash_version}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mix(x: np.ndarray, salt: np.ndarray | np.uint64) -> np.ndarray:
    """A 64-bit finaliser (murmur3 fmix64) over ``x ^ salt``; uint64 arithmetic wraps."""
    x = x ^ salt
    x ^= x >> _U64(33)
    x *= _M1
    x ^= x >> _U64(33)
    x *= _M2
    x ^= x >> _U64(33)
    return x


class Featurizer:
    """Turns a text into a sparse, l2-normalised hashed feature vector."""

    def __init__(self, config: FeatureConfig) -> None:
        self.config = config
        self._mask = _U64((1 << config.n_bits) - 1)
        self._word_cache: dict[str, int] = {}

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

    def hashes(self, text: str) -> np.ndarray:
        """All feature hashes of ``text`` (uint64, with repeats), before masking.

        NOTE: one vectorised mix over every key of every window, each key with its kind's
        salt; numpy's per-call overhead (~1 us) is most of the cost at these sizes.
        """
        c = self.config
        windows = self.windows(text)
        words = [_WORD_RE.findall(w) for w in windows]
        nums = [len(w) for w in words]
        hashed = np.array(self._word_hashes([x for w in words for x in w]), np.uint64)
        keys = [self._shape(text), hashed]
        salts = [_SHAPE, _WORD]
        start = 0
        for i, n in enumerate(nums):  # each window's words again, salted by position
            keys.append(hashed[start:start + n])
            salts.append(_HEAD if i == 0 else _TAIL)
            start += n
        if c.word_bigrams and len(hashed) > 1:
            pairs = hashed[:-1] * _P + hashed[1:]
            start = 0
            for n in nums:  # no bigram across the head / tail seam
                keys.append(pairs[start:start + n - 1] if n > 1 else pairs[:0])
                salts.append(_BIGRAM)
                start += n
        for w in windows:
            keys.append(self._char_keys(w[: c.char_window]))
            salts.append(_CHAR)
        salt = np.repeat(np.array(salts, np.uint64), [len(k) for k in keys])
        return _mix(np.concatenate(keys), salt)

    def transform(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Feature ids (int64, sorted unique) and values (float32, unit l2 norm)."""
        ids = (self.hashes(text) & self._mask).astype(np.int64)
        ids.sort()
        # run lengths of the sorted ids (np.unique, without its overhead)
        new = np.empty(len(ids), bool)
        new[0] = True
        np.not_equal(ids[1:], ids[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(ids)))
        val = np.log(counts, dtype=np.float32)
        val += np.float32(1.0)
        val /= np.sqrt(np.dot(val, val))
        return ids[starts], val

    def _word_hashes(self, words: list[str]) -> list[int | None]:
        cache = self._word_cache
        out: list[int | None] = list(map(cache.get, words))  # NOTE: a C loop; misses are rare
        if None in out:
            if len(cache) > _WORD_CACHE_SIZE:
                cache.clear()
            for i, w in enumerate(words):
                if out[i] is None:
                    out[i] = cache[w] = zlib.crc32(w.encode("utf-8", "surrogatepass"))
        return out

    def _char_keys(self, span: str) -> np.ndarray:
        n = self.config.char_ngram
        if n == 0 or len(span) < n:
            return np.zeros(0, np.uint64)
        cps = np.frombuffer(span.encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)
        m = len(cps) - n + 1
        h = cps[:m]
        for j in range(1, n):
            h = h * _P + cps[j: j + m]
        return h

    @staticmethod
    def _shape(text: str) -> np.ndarray:
        length_bucket = min(len(text).bit_length(), 20)
        newline_bucket = 32 + min(text.count("\n", 0, 4096), 20) // 4
        return np.array([length_bucket, newline_bucket], np.uint64)
