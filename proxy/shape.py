"""The proxy's fallback request-shape estimator (the router's classifier replaces it).

A shape estimator turns a parsed request body into a
:class:`router.base.RequestShape`. The proxy awaits it for every request: what
it does on the event loop must stay in the tens of microseconds whatever the
prompt's size (work of unbounded size goes to an executor). This one estimates
tokens from text length and picks a domain from a few keywords.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Protocol

from router.base import RequestOutcome, RequestShape

CHARS_PER_TOKEN = 4  # rough average for English text and code with BPE tokenizers
BLOCK_TOKENS = 512  # prefix-hash block size, as in the trace schema
_BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
MAX_HASH_BLOCKS = 32  # hash at most this many leading blocks (~16k tokens)

# (domain, keywords) in priority order; matched on the lower-cased last user text.
_DOMAIN_KEYWORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("code", ("```", "def ", "function", "class ", "import ", "code", "python", "bug")),
    ("translation", ("translate", "translation", "in french", "in german", "in spanish")),
    ("summarization", ("summarize", "summarise", "summary", "tl;dr")),
    ("math", ("solve", "calculate", "equation", "how many", "how much", "math")),
    ("extraction", ("extract", "json", "list all", "fields")),
    ("rag", ("context:", "document", "passage", "according to")),
    ("qa", ("what ", "who ", "when ", "where ", "why ", "?")),
)


class ShapeEstimator(Protocol):
    """Computes a request's shape from its parsed body; bounded work on the event loop."""

    async def estimate(self, body: Mapping[str, Any], endpoint: str) -> RequestShape:
        """``endpoint`` is the request path, e.g. ``/v1/chat/completions``."""
        ...

    def observe(self, outcome: RequestOutcome) -> None:
        """Learn from a finished request (e.g. output length per domain); never raises."""
        ...


def prompt_text(body: Mapping[str, Any]) -> str:
    """The request's prompt as one string (chat messages joined by newlines)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url"...}]
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_hashes(text: str) -> tuple[int, ...]:
    """Chained 64-bit hashes of the prompt's leading full 512-token blocks (equal = shared
    prefix), at most MAX_HASH_BLOCKS."""
    hashes = []
    h = hashlib.blake2b(digest_size=8)
    end = min(len(text) // _BLOCK_CHARS, MAX_HASH_BLOCKS) * _BLOCK_CHARS
    for start in range(0, end, _BLOCK_CHARS):
        h.update(text[start:start + _BLOCK_CHARS].encode())
        hashes.append(int.from_bytes(h.digest(), "little") >> 1)  # fits a signed int64
    return tuple(hashes)


_DOMAIN_PATTERNS = tuple((domain, re.compile("|".join(re.escape(k) for k in keywords)))
                         for domain, keywords in _DOMAIN_KEYWORDS)


def guess_domain(text: str) -> str:
    tail = text[-2000:].lower()
    for domain, pattern in _DOMAIN_PATTERNS:
        if pattern.search(tail):
            return domain
    return "chat"


class HeuristicShapeEstimator:
    """Length-based token estimate + keyword domain; the default until a classifier is wired."""

    async def estimate(self, body: Mapping[str, Any], endpoint: str) -> RequestShape:
        text = prompt_text(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            num_prompt_tokens = len(prompt)  # already token ids
        else:
            num_prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = max_tokens if isinstance(max_tokens, int) else None
        depth = body.get("speculative_depth")
        return RequestShape(
            domain=guess_domain(text),
            prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            predicted_output_tokens=max_tokens if max_tokens is not None else 256,
            stream=body.get("stream") is True,
            prefix_hashes=prefix_hashes(text), prefix_block_tokens=float(BLOCK_TOKENS),
            speculative_depth=depth if isinstance(depth, int) else None,
        )

    def observe(self, outcome: RequestOutcome) -> None:
        return None
