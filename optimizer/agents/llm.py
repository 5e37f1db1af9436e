"""The LLM agent (off by default): asks any OpenAI-compatible endpoint for candidates.

It sends the knobs with their allowed values, the best measured configs and
the current incumbent, and asks for a JSON list of knob assignments. Answers
are parsed leniently (the first JSON array in the text), each point is
repaired into the space, and anything unusable is dropped, never raised.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from typing import Any

from optimizer.agents.base import BoardView, Candidate, fresh
from optimizer.space import SearchSpace

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
        points = parse_points(text) if text else []
        configs = [c for c in (self.space.repair(p) for p in points) if c is not None]
        return [Candidate(c, reason="suggested by the LLM")
                for c in fresh(self.space, view, configs)[:num]]

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
    """The first JSON array of objects in ``text`` (models wrap JSON in prose or fences)."""
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
                    return [v for v in value if isinstance(v, dict)]
                break
    return []
