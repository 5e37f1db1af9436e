"""Token counting in the target's tokenizer, or an estimate when it is unknown.

``--tokenizer`` takes a Hugging Face model directory (``tokenizer.json`` and,
when present, ``tokenizer_config.json`` with a chat template) or a
``tokenizer.json`` path. Loading happens once, before the run, never in the
send loop.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from loadgen.errors import TokenizerError

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4.0  # NOTE: the usual English BPE ratio; only used without a tokenizer
_WORDS = re.compile(r"\s*\S+")


class TokenCounter(Protocol):
    """Counts tokens of prompt text; ``exact`` says whether counts are the target's own."""

    name: str
    exact: bool

    def count(self, text: str) -> int: ...

    def count_batch(self, texts: Sequence[str]) -> list[int]: ...

    def truncate(self, text: str, num_tokens: int) -> str:
        """The first ``num_tokens`` tokens of ``text``, as text."""
        ...

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str | None:
        """The templated prompt the server will tokenize, or None without a template."""
        ...


class HfTokenCounter:
    """Exact counts with a ``tokenizers`` tokenizer (no special tokens added)."""

    exact = True

    def __init__(self, path: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"cannot load tokenizer {file}: {e}") from e
        self.name = str(file)
        template = _chat_template(file.parent / "tokenizer_config.json")
        env = ImmutableSandboxedEnvironment()
        self._template = env.from_string(template) if template else None

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def truncate(self, text: str, num_tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= num_tokens else self._tok.decode(ids[:num_tokens])

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str | None:
        if self._template is None:
            return None
        return str(self._template.render(messages=list(messages), add_generation_prompt=True))


class EstimateTokenCounter:
    """Used only when no tokenizer is given; counts are estimates.

    Each word with its leading whitespace counts ``ceil(len / 4)`` tokens (at
    least one per word, as BPE gives), so counts add up across words the way
    prompt synthesis needs.
    """

    name = "estimate (ceil(chars/4) per word)"
    exact = False

    def count(self, text: str) -> int:
        return sum(math.ceil(len(w) / CHARS_PER_TOKEN) for w in _WORDS.findall(text))

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]

    def truncate(self, text: str, num_tokens: int) -> str:
        return text[:int(num_tokens * CHARS_PER_TOKEN)]

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str | None:
        return None


def _chat_template(config_path: Path) -> str | None:
    if not config_path.is_file():
        return None
    try:
        template = json.loads(config_path.read_text()).get("chat_template")
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", config_path, e)
        return None
    return template if isinstance(template, str) else None


def load_token_counter(path: str | Path | None) -> TokenCounter:
    """The tokenizer at ``path``, or the estimate when ``path`` is None."""
    if path is None:
        logger.warning("no --tokenizer: prompt lengths are estimates (%.0f chars/token)",
                       CHARS_PER_TOKEN)
        return EstimateTokenCounter()
    return HfTokenCounter(path)
