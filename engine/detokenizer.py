"""Incremental detokenization with stop strings that may span token boundaries.

Decoding each new token alone breaks multi-byte characters and word-leading
spaces, and decoding the whole output every step is quadratic. Instead (as in
TGI and vLLM) we decode a short window ``ids[prefix:]`` and emit only what it
adds beyond ``ids[prefix:read]``, holding back while the tail is an incomplete
UTF-8 character (U+FFFD).

Stop strings are searched in the text produced so far, starting a little
before the new text so a stop string split across tokens is found. Streaming
holds back the last ``max(len(stop)) - 1`` characters, which might be the start
of a stop string, until more text proves they are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.tokenizer import TextTokenizer

PROMPT_CONTEXT = 6  # prompt tokens decoded as left context of the first output token


@dataclass
class TextDelta:
    text: str  # newly releasable text
    stop_string: str | None  # the stop string that ended the request, if any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int],
                 stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # output text so far (trimmed at a stop string once found)
        self.num_emitted = 0  # characters of self.text already released

    def push(self, new_ids: Sequence[int]) -> TextDelta:
        """Add generated tokens; returns the text that may be released now."""
        self.ids.extend(new_ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            old_len = len(self.text)
            self.text += after[len(before):]
            stop = self._find_stop(old_len)
            if stop is not None:
                return TextDelta(self._release(len(self.text)), stop)
        return TextDelta(self._release(len(self.text) - self.hold), None)

    def finish(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        return self._release(len(self.text))

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s

    def _release(self, upto: int) -> str:
        if upto <= self.num_emitted:
            return ""
        out = self.text[self.num_emitted:upto]
        self.num_emitted = upto
        return out
