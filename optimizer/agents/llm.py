"""The LLM agent (off by default): asks any OpenAI-compatible endpoint for candidates.

It sends the knobs with their allowed values, the best measured configs and
the current incumbent, and asks for a JSON list of knob assignments. Answers
are parsed leniently (the first JSON array in the text), each point is
repaired into the space, and anything unusable is rejected, never raised: an
answer without a JSON list, an entry that is not an object, a knob outside the
space or a value it does not allow. Each rejection is kept with its reason
(:meth:`LlmAgent.take_rejections`) and the runner puts it on the board.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from typing import Any

from optimizer.agents.base import BoardView, Candidate, fresh
from optimizer.errors import SpaceError
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


class LlmAgent:
    name = "llm"

    def __init__(self, space: SearchSpace, base_url: str, model: str = "",
                 timeout_s: float = 60.0, api_key: str = "") -> None:
        self.space = space
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._rejections: list[str] = []

    def prompt(self, view: BoardView, num: int) -> str:
        knobs = {k.name: list(k.values) for k in self.space.knobs}
        top = [{"config": json.loads(k), "tokens_per_s": round(v, 1)} for k, v in view.top(8)]
        return (
            "You tune an LLM inference engine for output tokens per second on a fixed workload.\n"
            f"Knobs and allowed values: {json.dumps(knobs)}\n"
            "Constraints: max_num_batched_tokens >= max_num_seqs * (1 + spec_max_depth); "
            "spec_default_depth <= spec_max_depth; speculation needs depth >= 1.\n"
            f"Best measured so far: {json.dumps(top)}\n"
            f"Propose {num} new configurations not listed above. Answer with only a JSON list "
            "of objects mapping knob names to values.")

    def propose(self, view: BoardView, num: int) -> list[Candidate]:
        text = self._ask(self.prompt(view, num))
        if text is None:
            return []
        entries = parse_entries(text)
        if entries is None:
            self._reject(f"no JSON list in the answer: {text[:120]!r}")
            return []
        configs = [c for c in (self._vet(e) for e in entries) if c is not None]
        return [Candidate(c, reason="suggested by the LLM")
                for c in fresh(self.space, view, configs)[:num]]

    def take_rejections(self) -> list[str]:
        """Why proposals were rejected since the last call (for the board)."""
        out, self._rejections = self._rejections, []
        return out

    def _vet(self, entry: Any) -> CompiledConfig | None:
        if not isinstance(entry, dict):
            self._reject(f"not an object of knob values: {entry!r:.80}")
            return None
        names = {k.name for k in self.space.knobs}
        unknown = sorted(set(entry) - names)
        if unknown:
            self._reject(f"knob(s) {unknown} not in the search space {sorted(names)}")
            return None
        cfg = self.space.repair(entry)
        if cfg is None:
            try:
                self.space.build(entry)
                why = "no valid config near it"
            except SpaceError as e:
                why = str(e)
            self._reject(f"{json.dumps(entry)[:120]}: {why}")
        return cfg

    def _reject(self, why: str) -> None:
        logger.info("llm agent: rejected a proposal: %s", why)
        self._rejections.append(why[:300])

    def _ask(self, prompt: str) -> str | None:
        body = {"model": self.model, "temperature": 0.7, "max_tokens": 512,
                "messages": [{"role": "user", "content": prompt}]}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return str(json.loads(resp.read())["choices"][0]["message"]["content"])
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            logger.warning("llm agent: no usable answer from %s (%s)", self.base_url, e)
            return None


def parse_points(text: str) -> list[dict[str, Any]]:
    """The objects of the first JSON array in ``text`` (models wrap JSON in prose or fences)."""
    return [v for v in parse_entries(text) or [] if isinstance(v, dict)]


def parse_entries(text: str) -> list[Any] | None:
    """The first JSON array in ``text``, or None when there is none."""
    for m in re.finditer(r"\[", text):
        depth = 0
        for j in range(m.start(), len(text)):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                try:
                    value = json.loads(text[m.start(): j + 1])
                except ValueError:
                    break
                if isinstance(value, list):
                    return value
                break
    return None
