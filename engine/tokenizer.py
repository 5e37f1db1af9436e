"""Tokenizer and chat template of a checkpoint, without importing transformers.

``tokenizer.json`` is loaded with the ``tokenizers`` library; the chat template
and special tokens come from ``tokenizer_config.json`` and are rendered with
a sandboxed jinja2 environment, as transformers does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from engine.errors import CheckpointError, InvalidRequestError

logger = logging.getLogger(__name__)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return str(value.get("content"))
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class TextTokenizer:
    """Encode/decode text and render chat messages for one model directory."""

    def __init__(self, model_dir: str | Path, extra_eos_ids: Sequence[int] = ()) -> None:
        model_dir = Path(model_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception
            raise CheckpointError(f"{model_dir}/tokenizer.json: cannot load tokenizer: {e}") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        eos = {self.tokenizer.token_to_id(self.eos_token)} if self.eos_token else set()
        self.eos_token_ids = frozenset(i for i in eos | set(extra_eos_ids) if i is not None)
        self.vocab_size = self.tokenizer.get_vocab_size()
        # the most characters one token can stand for: a text longer than N times this has
        # more than N tokens, known without tokenizing it (engine.protocol)
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)),
                                   default=1)
        template = cfg.get("chat_template")
        self._template = None
        if isinstance(template, str):
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(template)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions",
                                      "messages")
        try:
            return str(self._template.render(messages=messages,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "",
                                             eos_token=self.eos_token or ""))
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"cannot render chat template: {e}", "messages") from e
