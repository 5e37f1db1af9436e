"""A bounded pool of recent outputs that the n-gram proposer searches too (cross-request lookup).

Prompt lookup only finds what the request's own context already contains. A
model's outputs also repeat *across* requests (the same phrasings, list
formats, closing lines), so the n-gram proposer keeps the outputs of the
last requests it served, up to ``max_tokens`` tokens, with an index from every
n-gram (``min_n .. max_n`` tokens) to where it last occurred; when the
context's own match is shorter than a match in the pool, the pool's
continuation is proposed instead (the idea of SuffixDecoding, Oliaro et al.
2024, with an n-gram index in place of a suffix tree)::

    pool.add(prompt_key=1, tokens=[7, 8, 9, 10])
    pool.lookup([4, 7, 8], prompt_key=2, longer_than=0, k=2, weak_match_depth=4)  # [9, 10]

NOTE: a request never gets an output of a request with the same prompt (the
``prompt_key``, a hash of the prompt tokens): the pool shares how the model
phrases things across prompts; it does not replay an earlier answer to the same
prompt, which would make any replayed benchmark measure a cache. Only the latest
output per prompt is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_HITS = 2  # per n-gram: the latest occurrences from this many different prompts


@dataclass(frozen=True)
class _Entry:
    prompt_key: int
    tokens: list[int]  # a finished request's output tokens


class OutputPool:
    """Recent outputs (FIFO, at most ``max_tokens`` tokens) and their n-gram index."""

    def __init__(self, max_tokens: int, min_n: int, max_n: int,
                 max_hits: int = MAX_HITS) -> None:
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self.max_hits = max_hits  # per n-gram: the latest occurrences from this many prompts
        self._entries: dict[int, _Entry] = {}  # insertion order = age
        self._by_prompt: dict[int, int] = {}  # prompt_key -> entry id
        self._next_id = 0
        self.num_tokens = 0
        self._stale_tokens = 0  # tokens of removed entries still in the index
        # [n]: n-gram -> [(entry id, end position)], latest first, distinct prompts
        self._index: list[dict[tuple[int, ...], list[tuple[int, int]]]] = []
        self._clear_index()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt_key: int, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` (one request's output); replaces that prompt's previous output."""
        if len(tokens) < 2 or self.max_tokens <= 0:
            return
        old = self._by_prompt.pop(prompt_key, None)
        if old is not None:
            self._remove(old)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        entry = _Entry(prompt_key, list(tokens[-self.max_tokens:]))
        self._entries[entry_id] = entry
        self._by_prompt[prompt_key] = entry_id
        self.num_tokens += len(entry.tokens)
        self._index_entry(entry_id, entry)
        while self.num_tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))
        if self._stale_tokens > self.max_tokens:  # amortised: rebuild once per pool's worth
            self._rebuild()

    def lookup(self, context: Sequence[int], prompt_key: int | None, longer_than: int, k: int,
               weak_match_depth: int | None, depth_caps: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``context`` found in the pool,
        if that suffix is longer than ``longer_than`` tokens; [] otherwise. A match shorter
        than ``max_n`` proposes at most ``weak_match_depth`` tokens (as the context search),
        and a match of ``m <= len(depth_caps)`` tokens at most ``depth_caps[m - 1]``."""
        lowest = max(longer_than + 1, self.min_n)
        for m in range(min(self.max_n, len(context)), lowest - 1, -1):
            for entry_id, end in self._index[m].get(tuple(context[len(context) - m:]), ()):
                entry = self._entries.get(entry_id)
                if entry is None or entry.prompt_key == prompt_key:
                    continue
                depth = k if m == self.max_n or weak_match_depth is None else min(
                    k, weak_match_depth)
                if m <= len(depth_caps):
                    depth = min(depth, depth_caps[m - 1])
                return entry.tokens[end + 1:end + 1 + depth]
        return []

    def _index_entry(self, entry_id: int, entry: _Entry) -> None:
        tokens, key = entry.tokens, entry.prompt_key
        for j in range(len(tokens) - 1):  # ends followed by at least one token
            for m in range(self.min_n, min(self.max_n, j + 1) + 1):
                gram = tuple(tokens[j - m + 1:j + 1])
                hits = self._index[m].get(gram)
                if hits is None:
                    self._index[m][gram] = [(entry_id, j)]
                    continue
                kept = [h for h in hits if h[0] != entry_id and self._key_of(h[0]) not in
                        (None, key)]
                self._index[m][gram] = [(entry_id, j), *kept[:self.max_hits - 1]]

    def _key_of(self, entry_id: int) -> int | None:
        entry = self._entries.get(entry_id)
        return None if entry is None else entry.prompt_key

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        if self._by_prompt.get(entry.prompt_key) == entry_id:
            del self._by_prompt[entry.prompt_key]
        self.num_tokens -= len(entry.tokens)
        self._stale_tokens += len(entry.tokens)

    def _clear_index(self) -> None:
        self._index = [{} for _ in range(self.max_n + 1)]
        self._stale_tokens = 0

    def _rebuild(self) -> None:
        self._clear_index()
        for entry_id, entry in self._entries.items():  # oldest first: the latest ends up first
            self._index_entry(entry_id, entry)
