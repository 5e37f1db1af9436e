"""Prompt sets without timestamps: Spec-Bench questions, ShareGPT, plain JSONL prompts.

These carry text, so nothing is synthesised; arrivals come from a rate or a
concurrency (``--arrival poisson|gamma|concurrency``), never from the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loadgen.errors import TraceLineError
from loadgen.readers.base import BadLines, finite_float
from loadgen.readers.json_traces import (
    json_objects,
    messages_of,
    optional_int,
    sniff_json_keys,
)
from loadgen.request import TraceRequest

# Spec-Bench / MT-bench categories -> polyinfer DOMAINS.
SPEC_BENCH_DOMAINS = {
    "translation": "translation", "summarization": "summarization", "qa": "qa",
    "math_reasoning": "math", "math": "math", "reasoning": "math", "rag": "rag",
    "coding": "code", "extraction": "extraction", "writing": "chat", "roleplay": "chat",
    "stem": "qa", "humanities": "qa",
}
PROMPT_KEYS = ("prompt", "text", "question", "messages")


def user_turn(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


class SpecBenchReader:
    """Spec-Bench ``question.jsonl``: ``category`` and ``turns``; the first turn is sent."""

    name = "specbench"

    def sniff(self, first_line: str) -> bool:
        return {"turns", "category"} <= sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            turns, category = obj.get("turns"), obj.get("category")
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
                bad.reject(TraceLineError(str(path), line, "turns: expected a list of strings"))
                continue
            if not isinstance(category, str) or category not in SPEC_BENCH_DOMAINS:
                bad.reject(TraceLineError(str(path), line, f"unknown category {category!r}"))
                continue
            yield TraceRequest(line=line, messages=user_turn(turns[0]),
                               domain=SPEC_BENCH_DOMAINS[category])


def sharegpt_request(line: int, obj: dict[str, Any]) -> TraceRequest:
    """First human turn is the prompt; the first reply after it sets the output length."""
    turns = obj.get("conversations")
    if not isinstance(turns, list):
        raise ValueError("conversations: expected a list")
    texts = [(t.get("from"), t.get("value")) for t in turns if isinstance(t, dict)]
    for i, (who, value) in enumerate(texts):
        if who in ("human", "user") and isinstance(value, str) and value:
            reply = next((v for w, v in texts[i + 1:] if w in ("gpt", "assistant")
                          and isinstance(v, str)), None)
            return TraceRequest(line=line, messages=user_turn(value), reference_output=reply)
    raise ValueError("conversations: no human turn")


class ShareGptReader:
    """ShareGPT: a JSON array (or JSON lines) of ``{"conversations": [{"from", "value"}]}``.

    For the array form, "line" numbers are 1-based record numbers.
    """

    name = "sharegpt"

    def sniff(self, first_line: str) -> bool:
        return first_line.startswith("[") or "conversations" in sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in self._objects(path, bad):
            try:
                yield sharegpt_request(line, obj)
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))

    @staticmethod
    def _objects(path: Path, bad: BadLines) -> Iterator[tuple[int, dict[str, Any]]]:
        raw = path.read_bytes()
        if not raw.lstrip().startswith(b"["):
            yield from json_objects(path, bad)
            return
        try:
            records = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise TraceLineError(str(path), 1, f"not a JSON array ({e})") from e
        for number, obj in enumerate(records, start=1):
            if isinstance(obj, dict):
                yield number, obj
            else:
                bad.reject(TraceLineError(str(path), number, "record is not a JSON object"))


class JsonlPromptsReader:
    """Plain JSON lines: ``prompt``/``text``/``question`` or ``messages``, plus optional
    ``max_tokens``/``output_tokens``, ``domain`` and ``timestamp`` (seconds).

    ``answer``/``reference`` text, when present, sets the output length
    (so GSM8K's train.jsonl replays as is).
    """

    name = "prompts"

    def sniff(self, first_line: str) -> bool:
        return bool(set(PROMPT_KEYS) & sniff_json_keys(first_line))

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            try:
                yield self._record(line, obj)
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))

    @staticmethod
    def _record(line: int, obj: dict[str, Any]) -> TraceRequest:
        messages = obj.get("messages")
        prompt = next((obj[k] for k in ("prompt", "text", "question") if k in obj), None)
        if messages is None and not (isinstance(prompt, str) and prompt):
            raise ValueError(f"expected a non-empty string under one of {PROMPT_KEYS}")
        output = optional_int(obj, "max_tokens")
        if output is None:
            output = optional_int(obj, "output_tokens")
        reference = obj.get("answer", obj.get("reference"))
        timestamp = obj.get("timestamp")
        domain = obj.get("domain")
        return TraceRequest(
            line=line,
            timestamp_s=None if timestamp is None else finite_float(timestamp, "timestamp"),
            prompt=prompt if messages is None else None,
            messages=None if messages is None else messages_of(messages, "messages"),
            reference_output=reference if isinstance(reference, str) else None,
            output_tokens=output,
            domain=domain if isinstance(domain, str) else None,
        )
