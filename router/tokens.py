"""Prompt token counts and prefix-block hashes, cheap enough for the event loop.

With the served model's tokenizer (``tokenizers``, from ``tokenizer.json``)
the count is exact for prompts up to ``exact_max_chars`` rendered characters;
longer prompts encode only a head of ``sample_chars`` and extrapolate with
that prompt's own characters-per-token ratio (so a 20 kB RAG prompt costs the
same as a 1 kB one). Without a tokenizer the count is ``chars / chars_per_token``.

Chat messages are rendered as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``
+ the generation prompt), which is exactly the bundled models' template and a
close approximation of other templates' overhead.

Prefix hashes: blake2b over fixed blocks of ``block_chars`` rendered
characters (about 512 tokens), chained so a block hash identifies the whole
prefix up to it. Equal prefixes give equal hashes in every process.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenConfig:
    exact_max_chars: int = 1536  # encode the whole prompt up to this many characters
    sample_chars: int = 1024  # otherwise encode this head and extrapolate
    chars_per_token: float = 4.0  # used without a tokenizer
    block_chars: int = 2048  # prefix-hash block, ~512 tokens at 4 chars/token
    max_hash_blocks: int = 64  # hash at most this many leading blocks

    def __post_init__(self) -> None:
        if not 0 < self.sample_chars <= self.exact_max_chars:
            raise ValueError("expected 0 < sample_chars <= exact_max_chars")
        if self.chars_per_token <= 0 or self.block_chars <= 0 or self.max_hash_blocks < 0:
            raise ValueError("chars_per_token and block_chars must be > 0, max_hash_blocks >= 0")


@dataclass(frozen=True)
class TokenCount:
    num_tokens: int
    exact: bool


class TokenCounter:
    """Counts prompt tokens (exactly when a tokenizer is known) and hashes prefix blocks."""

    def __init__(self, config: TokenConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self._tok = tokenizer  # tokenizers.Tokenizer or None

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None, config: TokenConfig | None = None
             ) -> TokenCounter:
        """Load ``tokenizer.json`` from a model directory; ``None`` (or no file) = estimate."""
        config = config or TokenConfig()
        if tokenizer_dir is None:
            return cls(config)
        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            logger.warning("no tokenizer at %s; prompt tokens will be estimated", path)
            return cls(config)
        from tokenizers import Tokenizer

        return cls(config, Tokenizer.from_file(str(path)))

    @property
    def has_tokenizer(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> TokenCount:
        c = self.config
        if self._tok is None:
            return TokenCount(max(1, round(len(text) / c.chars_per_token)) if text else 0, False)
        if len(text) <= c.exact_max_chars:
            return TokenCount(len(self._tok.encode(text, add_special_tokens=False)), True)
        head = len(self._tok.encode(text[: c.sample_chars], add_special_tokens=False))
        return TokenCount(round(head * len(text) / c.sample_chars), False)

    def prefix_hashes(self, text: str) -> tuple[int, ...]:
        c = self.config
        num_blocks = min(len(text) // c.block_chars, c.max_hash_blocks)
        out: list[int] = []
        h = hashlib.blake2b(digest_size=8)
        for i in range(num_blocks):
            h.update(text[i * c.block_chars: (i + 1) * c.block_chars].encode("utf-8", "replace"))
            out.append(int.from_bytes(h.copy().digest(), "little") >> 1)  # non-negative int63
        return tuple(out)


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML rendering of OpenAI chat messages (text parts only)."""
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{message_text(m)}<|im_end|>\n"
             for m in messages if isinstance(m, Mapping)]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one message: a string, or the ``text`` parts of a content list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""
