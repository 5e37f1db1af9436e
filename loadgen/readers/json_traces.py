"""JSON-lines traces with timestamps: polyinfer's own trace records and Mooncake."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loadgen.errors import TraceLineError
from loadgen.readers.base import BadLines, finite_float, non_negative_int, numbered_lines
from loadgen.request import TraceRequest
from polyinfer.trace import block_ids, parse_record


def json_objects(path: Path, bad: BadLines) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every line that parses as a JSON object."""
    for line, text in numbered_lines(path):
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            bad.reject(TraceLineError(str(path), line, f"not JSON ({e})"))
            continue
        if not isinstance(obj, dict):
            bad.reject(TraceLineError(str(path), line, "not a JSON object"))
            continue
        yield line, obj


def sniff_json_keys(first_line: str) -> set[str]:
    try:
        obj = orjson.loads(first_line)
    except orjson.JSONDecodeError:
        return set()
    return set(obj) if isinstance(obj, dict) else set()


def optional_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return None if value is None else non_negative_int(value, key)


class MooncakeReader:
    """Mooncake: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Each hash id names one 512-token block of the prompt; equal ids in
    different requests are the same text, so replays keep the prefix sharing.
    """

    name = "mooncake"

    def sniff(self, first_line: str) -> bool:
        return {"input_length", "output_length"} <= sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            try:
                yield TraceRequest(
                    line=line,
                    timestamp_s=finite_float(obj["timestamp"], "timestamp") / 1000.0,
                    prompt_tokens=non_negative_int(obj["input_length"], "input_length"),
                    output_tokens=non_negative_int(obj["output_length"], "output_length"),
                    hash_ids=block_ids(obj.get("hash_ids"), "hash_ids"),
                )
            except KeyError as e:
                bad.reject(TraceLineError(str(path), line, f"missing key {e}"))
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))


def messages_of(value: object, key: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key}: expected a non-empty list of messages")
    out = []
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{key}: each message needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


class PolyinferTraceReader:
    """polyinfer's own trace records (:mod:`polyinfer.trace`), one JSON object per request.

    The replayed output length is what the recorded request produced
    (``completion_tokens``), falling back to its ``max_tokens``. Prompt text is
    used when the operator had it recorded (``prompt_text``, sent as a user
    message when ``endpoint`` was chat; or ``prompt`` / ``messages``);
    otherwise a prompt of ``prompt_tokens`` is synthesised, sharing blocks per
    ``prefix_hashes``, each block ``prefix_block_tokens`` tokens (traces that
    do not say: the replay's ``--block-tokens``, 512). A record whose block
    size is not a number in 1..65536 is a bad line.
    """

    name = "polyinfer"

    def sniff(self, first_line: str) -> bool:
        return {"ts", "request_id", "prompt_tokens"} <= sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            try:
                yield self._record(line, obj)
            except KeyError as e:
                bad.reject(TraceLineError(str(path), line, f"missing key {e}"))
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))

    @staticmethod
    def _record(line: int, obj: dict[str, Any]) -> TraceRequest:
        if "ts" not in obj:
            raise KeyError("ts")
        record = parse_record(obj)
        prompt = record.prompt_text if record.prompt_text is not None else obj.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("prompt: expected a string")
        messages = obj.get("messages")
        if prompt is not None and messages is None and "chat" in record.endpoint:
            messages, prompt = [{"role": "user", "content": prompt}], None
        return TraceRequest(
            line=line,
            timestamp_s=record.ts,
            prompt=prompt,
            messages=None if messages is None else messages_of(messages, "messages"),
            prompt_tokens=record.prompt_tokens,
            output_tokens=record.completion_tokens or record.max_tokens,
            hash_ids=record.prefix_hashes,
            block_tokens=record.prefix_block_tokens,
            domain=record.domain or None,
        )
