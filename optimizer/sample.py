"""A replay sample: trace records -> concrete requests (prompt text + max_tokens).

Traces carry no prompt text unless the operator records it, so prompts are
synthesised per domain at the recorded token length from text that is on
every machine: Python standard-library source for ``code`` (repetitive, like
real code completion), templated word problems for ``math``, and library
docstrings (prose) for the rest. Lengths are measured with the served
model's tokenizer and capped (``SampleConfig``) so a replay stays short on a
CPU. The same records + seed always give the same requests.

NOTE: not :class:`loadgen.synth.PromptSynthesizer`, which builds prompts of an exact
length from one corpus, with shared prefix blocks: a replay here is judged on what
speculation accepts, which depends on each domain's text (code's repeats), so the text
is the domain's own, cut by the same tokenizer wrapper (:class:`loadgen.tokenizer.HfTokenCounter`).
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.tokenizer import HfTokenCounter
from optimizer.errors import OptimizerError
from polyinfer.trace import TraceRecord

logger = logging.getLogger(__name__)

_CODE_MODULES = ("json.decoder", "textwrap", "fractions", "heapq", "bisect", "shlex", "string",
                 "statistics", "csv", "argparse")
_PROSE_MODULES = ("collections", "functools", "itertools", "pathlib", "random", "logging",
                  "datetime", "decimal", "argparse", "json")


@dataclass(frozen=True)
class SampleConfig:
    max_prompt_tokens: int = 256  # longer recorded prompts are cut to this
    max_output_tokens: int = 48  # longer recorded outputs are cut to this
    min_output_tokens: int = 4
    time_scale: float = 1.0  # arrival offsets are divided by this (>1 replays faster)

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 8:
            raise OptimizerError(f"max_prompt_tokens: expected >= 8, got {self.max_prompt_tokens}")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise OptimizerError(
                f"min_output_tokens: expected 1..max_output_tokens ({self.max_output_tokens}), "
                f"got {self.min_output_tokens}")
        if self.time_scale <= 0:
            raise OptimizerError(f"time_scale: expected > 0, got {self.time_scale}")


@dataclass(frozen=True)
class ReplayRequest:
    domain: str
    prompt: str
    prompt_tokens: int  # as tokenised here
    max_tokens: int
    offset_s: float  # arrival time relative to the first request, seconds


class DomainPromptSynthesizer:
    """Makes a prompt of a given domain and token length; deterministic per seed."""

    def __init__(self, tokenizer_path: str | Path, seed: int = 0) -> None:
        self._counter = HfTokenCounter(tokenizer_path)
        self._rng = random.Random(seed)
        self._code = _module_texts(_CODE_MODULES, source=True)
        self._prose = _module_texts(_PROSE_MODULES, source=False)

    def count_tokens(self, text: str) -> int:
        return self._counter.count(text)

    def make(self, domain: str, num_tokens: int) -> str:
        return self.truncate(self._raw_text(domain, num_tokens), num_tokens)

    def truncate(self, text: str, num_tokens: int) -> str:
        """``text`` cut to at most ``num_tokens`` tokens (unchanged when shorter)."""
        return self._counter.truncate(text, num_tokens)

    def _raw_text(self, domain: str, num_tokens: int) -> str:
        # NOTE: ~4 characters per token, doubled for slack; cut by tokens afterwards.
        num_chars = 8 * num_tokens + 64
        if domain == "code":
            return _slice(self._rng.choice(self._code), num_chars, self._rng)
        if domain == "math":
            return " ".join(self._word_problem() for _ in range(1 + num_chars // 120))
        return _slice(self._rng.choice(self._prose), num_chars, self._rng)

    def _word_problem(self) -> str:
        r = self._rng
        a, b, c = r.randint(2, 90), r.randint(2, 40), r.randint(2, 9)
        name = r.choice(("Ann", "Ben", "Chen", "Dara", "Eli", "Fatima"))
        item = r.choice(("apples", "books", "coins", "marbles", "pencils"))
        return (f"{name} has {a} {item}. She buys {b} more and then gives away a {c}th of them. "
                f"How many {item} does {name} have left? Show your reasoning step by step.")


def _module_texts(names: Sequence[str], source: bool) -> list[str]:
    import importlib

    texts = []
    for name in names:
        mod = importlib.import_module(name)
        if source:
            texts.append(inspect.getsource(mod))
        else:
            docs = [inspect.getdoc(obj) or "" for _, obj in inspect.getmembers(mod)]
            texts.append("\n\n".join([inspect.getdoc(mod) or ""] + [d for d in docs if len(d) > 80]))
    return [t for t in texts if len(t) > 2000]


def _slice(text: str, num_chars: int, rng: random.Random) -> str:
    while len(text) < num_chars:
        text = text + "\n" + text
    start = rng.randrange(0, len(text) - num_chars + 1)
    return text[start: start + num_chars]


def build_replay(records: Sequence[TraceRecord], synth: DomainPromptSynthesizer,
                 config: SampleConfig = SampleConfig()) -> list[ReplayRequest]:
    """Records (e.g. a stratified sample) -> requests, in arrival order."""
    ordered = sorted(records, key=lambda r: r.ts)
    t0 = ordered[0].ts if ordered else 0.0
    out = []
    for r in ordered:
        num_prompt = max(1, min(r.prompt_tokens or 0, config.max_prompt_tokens))
        # NOTE: a recorded prompt is replayed as recorded, cut to the cap like a synthetic one
        prompt = (synth.truncate(r.prompt_text, config.max_prompt_tokens)
                  if r.prompt_text is not None else synth.make(r.domain, num_prompt))
        max_tokens = max(config.min_output_tokens, min(r.output_tokens, config.max_output_tokens))
        out.append(ReplayRequest(r.domain, prompt, synth.count_tokens(prompt), max_tokens,
                                 (r.ts - t0) / config.time_scale))
    return out
